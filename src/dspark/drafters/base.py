"""What every drafter shares: the target dimensions it is built for, the frozen target parts it
borrows (embedding, LM head), and the records it returns."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .layers import LayerShape


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
    of its optimizer and its checkpoint."""

    embed: Callable[[Tensor], Tensor]
    lm_weight: Tensor  # [V, d]
    softcap: float | None = None

    @classmethod
    def of(cls, target) -> Shared:
        return cls(embed=target.embed, lm_weight=target.lm_head_weight, softcap=target.softcap)


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
    tokens: Tensor  # [R, γ]
    probs: Tensor  # [R, γ, V] float32: the exact distributions the tokens were sampled from
    confidence_logits: Tensor | None = None  # [R, γ]


@dataclass
class DraftCache:
    """Per-request drafter state across rounds: per-layer context keys/values [R, Hkv, C, hd]
    (padded; `length` says how many are real) and anything else a drafter keeps in `extra`."""

    k: list[Tensor]
    v: list[Tensor]
    length: Tensor  # [R] long
    extra: dict = field(default_factory=dict)


def layer_shape(dims: TargetDims, cfg) -> LayerShape:
    hidden = cfg.get("hidden_size") or dims.hidden_size
    if hidden != dims.hidden_size:
        raise ValueError(
            f"drafter.hidden_size={hidden} differs from the target's {dims.hidden_size}: the drafter shares "
            f"the target's embedding and LM head, so leave drafter.hidden_size null"
        )
    return LayerShape(
        hidden_size=hidden,
        intermediate_size=cfg.get("intermediate_size") or dims.intermediate_size,
        num_heads=cfg.get("num_heads") or dims.num_heads,
        num_kv_heads=cfg.get("num_kv_heads") or dims.num_kv_heads,
        head_dim=cfg.get("head_dim") or dims.head_dim,
        rope_theta=cfg.get("rope_theta") or dims.rope_theta,
        rms_norm_eps=dims.rms_norm_eps,
    )


def output_logits(x: Tensor, weight: Tensor, softcap: float | None) -> Tensor:
    logits = (x @ weight.t().to(x.dtype)).float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def empty_cache(layers: nn.ModuleList, r: int, ref: Tensor) -> DraftCache:
    s = layers[0].attn.s
    shape = (r, s.num_kv_heads, 0, s.head_dim)
    return DraftCache(
        k=[ref.new_zeros(shape) for _ in layers],
        v=[ref.new_zeros(shape) for _ in layers],
        length=torch.zeros(r, dtype=torch.long, device=ref.device),
    )


def append_kv(cache: DraftCache, layer_kv: list[tuple[Tensor, Tensor]], valid: Tensor) -> None:
    """Write new keys/values [R, Hkv, N, hd] after each request's current length; `valid` [R, N] must
    be a prefix mask (request r contributes its first valid[r].sum() entries)."""
    counts = valid.sum(1)
    need = int((cache.length + counts).max()) if counts.numel() else 0
    for i, (k_new, v_new) in enumerate(layer_kv):
        if need > cache.k[i].shape[2]:
            grow = max(need, 2 * cache.k[i].shape[2]) - cache.k[i].shape[2]
            pad = cache.k[i].new_zeros(*cache.k[i].shape[:2], grow, cache.k[i].shape[3])
            cache.k[i] = torch.cat([cache.k[i], pad], dim=2)
            cache.v[i] = torch.cat([cache.v[i], pad.clone()], dim=2)
        rows, cols = valid.nonzero(as_tuple=True)
        slots = cache.length[rows] + cols
        cache.k[i][rows, :, slots] = k_new[rows, :, cols].to(cache.k[i].dtype)
        cache.v[i][rows, :, slots] = v_new[rows, :, cols].to(cache.v[i].dtype)
    cache.length += counts


def select_cache(cache: DraftCache, index: Tensor) -> DraftCache:
    """The cache of a subset of requests (continuous batching)."""
    return DraftCache(
        k=[k[index] for k in cache.k],
        v=[v[index] for v in cache.v],
        length=cache.length[index],
        extra={key: val[index] for key, val in cache.extra.items()},
    )
