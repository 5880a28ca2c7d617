"""The records that cross the target / drafter / engine / objective seams. Plain data: whoever
produces one and whoever consumes one share this module and nothing else."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["DraftCache", "DraftOutput", "Proposal", "Shared", "TargetDims"]


@dataclass(frozen=True)
class TargetDims:
    """The target facts a drafter's shape depends on (saved in the drafter's config.json)."""

    hidden_size: int
    vocab_size: int
    num_taps: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    rms_norm_eps: float
    mask_token_id: int

    @classmethod
    def of(cls, target) -> TargetDims:
        return cls(
            hidden_size=target.hidden_size,
            vocab_size=target.vocab_size,
            num_taps=len(target.layer_ids),
            num_heads=target.num_heads,
            num_kv_heads=target.num_kv_heads,
            head_dim=target.head_dim,
            intermediate_size=target.intermediate_size,
            rope_theta=target.rope_theta,
            rms_norm_eps=target.rms_norm_eps,
            mask_token_id=target.mask_token_id,
        )


@dataclass
class Shared:
    """Frozen target parts lent to the drafter; never registered as its parameters, so they stay out
    of its optimizer and its checkpoint.

    With a draft vocabulary (``vocab``: K target token ids, FR-Spec / EAGLE-3 style) the drafter
    drafts among those K tokens only: ``lm_weight`` holds just their rows, so the draft step's LM
    head and softmax cover K columns; the drafter maps what it draws back to target ids
    (``target_ids``) and its proposal's distributions stay over the K columns, which verification
    reads through ``index`` (a token off the vocabulary has draft probability 0: still exact)."""

    embed: Callable[[Tensor], Tensor]
    lm_weight: Tensor  # [V, d], or [K, d]: the rows of ``vocab``
    softcap: float | None = None
    vocab: Tensor | None = None  # [K] long, sorted target ids; None: the whole vocabulary
    index: Tensor | None = None  # [V] long: each target id's column in ``vocab``, -1 off it

    @classmethod
    def of(cls, target, vocab: Tensor | None = None) -> Shared:
        weight, index = target.lm_head_weight, None
        if vocab is not None:
            vocab = vocab.to(device=weight.device, dtype=torch.long)
            weight = weight[vocab]  # a copy, made once: the draft step never reads the other rows
            index = torch.full((target.vocab_size,), -1, dtype=torch.long, device=weight.device)
            index[vocab] = torch.arange(vocab.numel(), device=weight.device)
        return cls(embed=target.embed, lm_weight=weight, softcap=target.softcap, vocab=vocab, index=index)

    def target_ids(self, index: Tensor) -> Tensor:
        """Target token ids of draft-vocabulary indices (the indices themselves without one)."""
        return index if self.vocab is None else self.vocab[index]


@dataclass
class DraftOutput:
    """Teacher-forced drafts for training. Rows are (sequence, anchor, position k)."""

    features: Tensor  # [B, A, γ, d + r]: draft logits = features @ [W_lm | bias_weight]ᵀ
    bias_weight: Tensor | None  # [V, r] trainable low-rank logit bias (DSpark's W2); None: r = 0
    confidence_logits: Tensor | None  # [B, A, γ]
    target_positions: Tensor  # [B, A, γ]: position whose target distribution matches draft k
    valid: Tensor  # [B, A, γ] bool: eval mask (contiguous loss mask, inside the sequence)
    labels: Tensor  # [B, A, γ] the true next tokens

    def logits(self, lm_weight: Tensor) -> Tensor:
        """Full draft logits [B, A, γ, V] (the loss never builds these; tests and tools do)."""
        weight = lm_weight if self.bias_weight is None else torch.cat([lm_weight, self.bias_weight], 1)
        return self.features @ weight.t().to(self.features.dtype)


@dataclass
class Proposal:
    tokens: Tensor  # [R, γ] target ids
    # [R, γ, V] float32 ([R, γ, K] over a draft vocabulary's columns, ``Shared.vocab``): the exact
    # distributions the tokens were sampled from; None from a fused draft step at T = 0, whose
    # greedy verification reads the tokens alone
    probs: Tensor | None
    confidence_logits: Tensor | None = None  # [R, γ]


@dataclass
class DraftCache:
    """Per-request drafter state across rounds: per-layer context keys/values [R, Hkv, C, hd]
    (padded; `length` says how many are real) and anything else a drafter keeps in `extra`.
    `block_slots` > 0: the last that many of the C slots are no context but room where a draft
    step writes its block's own keys/values in place (a static cache), instead of concatenating
    them after the context (which copies the whole context once per layer and step)."""

    k: list[Tensor]
    v: list[Tensor]
    length: Tensor  # [R] long
    extra: dict = field(default_factory=dict)
    block_slots: int = 0
