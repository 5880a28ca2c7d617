"""DSpark (§3.1–3.2): the DFlash backbone, a light sequential head that adds a prefix-dependent
low-rank bias to each position's logits, and a confidence head predicting prefix survival."""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.errors import ConfigError
from ..core.sampling import greedy_tokens
from ..core.types import TargetDims
from ..kernels.sample_step import sample_step
from .base import head_first_position, head_product, soft_capped
from .derived import DerivedWeights
from .dflash import BlockDrafter, check_slots
from .heads import HEADS, ConfidenceHead
from .registry import register


@register("dspark")
class DSparkDrafter(BlockDrafter):
    def __init__(self, dims: TargetDims, cfg, head_cfg=None):
        super().__init__(dims, cfg)
        name = head_cfg.name if head_cfg is not None else "none"
        self.head = (
            HEADS[name](dims.vocab_size, dims.hidden_size, int(head_cfg.rank)) if name != "none" else None
        )
        # Draft positions before this one (1-based) take the backbone's logits alone; the head's state,
        # if any, starts here.
        self.head_skip = head_first_position(head_cfg) - 1 if self.head is not None else 0
        conf = cfg.get("confidence") or {}
        self.confidence = None
        if self.config_has_confidence(cfg):
            prev_dim = self.head.rank if self.head is not None and conf.get("use_prev_embedding", True) else 0
            self.confidence = ConfidenceHead(dims.hidden_size, prev_dim)
        self.confidence_detached = bool(conf.get("detach_features", False))
        self._vocab_rows: dict[int, tuple] = {}  # id(draft vocabulary) -> (its weakref, W2's rows)

    @classmethod
    def check_config(cls, drafter_cfg, head_cfg) -> None:
        head = head_cfg.name if head_cfg is not None else "none"
        if head not in (*HEADS, "none"):
            raise ConfigError(f"head.name '{head}' is not one of {(*HEADS, 'none')}")
        if head != "none" and int(head_cfg.rank) <= 0:
            raise ConfigError(f"head.rank must be positive for head={head}, got {head_cfg.rank}")
        check_slots(drafter_cfg)
        first, gamma = head_first_position(head_cfg), cls.config_gamma(drafter_cfg)
        if head != "none" and not 1 <= first <= gamma:
            raise ConfigError(
                f"head.first_position={first} is not a draft position of this block (1..{gamma}, "
                f"drafter.block_size={drafter_cfg['block_size']}): 1 lets the head bias every position"
            )

    @classmethod
    def config_has_confidence(cls, drafter_cfg) -> bool:
        return bool((drafter_cfg.get("confidence") or {}).get("enabled", True))

    @property
    def has_confidence(self) -> bool:
        return self.confidence is not None

    def _confidence(self, h: Tensor, prev: Tensor) -> Tensor | None:
        if self.confidence is None:
            return None
        emb = self.head.W1(prev) if self.confidence.prev_dim else None
        if self.confidence_detached:  # the confidence loss reaches the confidence head's own weights only
            h, emb = h.detach(), None if emb is None else emb.detach()
        return self.confidence(h, emb)

    def head_features(self, hidden, prev):
        conf = self._confidence(hidden, prev)
        if self.head is None:
            return hidden, conf
        s = self.head_skip
        b = self.head.sequence(hidden[:, s:], prev[:, s:]).to(hidden.dtype)
        if s:  # no bias before the head's first position: zero features there
            b = torch.cat([b.new_zeros(b.shape[0], s, b.shape[-1]), b], dim=1)
        return torch.cat([hidden, b], dim=-1), conf

    def bias_weight(self) -> Tensor | None:
        return None if self.head is None else self.head.W2.weight

    def vocab_bias_weight(self, shared) -> Tensor | None:
        """W2's rows [K, r] for ``shared``'s draft vocabulary, kept in step with W2 (one copy per
        vocabulary, so an engine's captured graphs keep reading their own); None where W2 itself
        serves (no draft vocabulary, or no head)."""
        vocab = shared.vocab
        if vocab is None or self.head is None:
            return None
        entry = self._vocab_rows.get(id(vocab))
        if entry is None or entry[0]() is not vocab:
            self._vocab_rows = {k: e for k, e in self._vocab_rows.items() if e[0]() is not None}
            ref = weakref.ref(vocab)
            entry = (ref, DerivedWeights(lambda: [self.head.W2.weight, ref()], lambda w, ids: w[ids]))
            self._vocab_rows[id(vocab)] = entry
        return entry[1].get()

    def sample_block(self, hidden, anchor, shared, temperature, u):
        """Left to right over the positions of ``hidden`` [R, n, d]: each position's exact
        distribution is conditioned on the token actually sampled before it, so verification
        against these probabilities stays lossless. One LM-head product for the n positions, then
        per position the head's bias and the fused softmax + inverse-CDF draw
        (``kernels.sample_step``; its PyTorch reference off CUDA). The confidences need only each
        position's hidden state and the token before it: one batched pass after the loop."""
        base = head_product(hidden, shared.lm_weight)  # [R, n, V]; upcast in the sampler
        w2 = self.vocab_bias_weight(shared)
        prev = anchor
        state = self.head.init_state(anchor.shape[0], hidden) if self.head is not None else None
        tokens, probs = [], []
        for k in range(hidden.shape[1]):
            if k < self.head_skip:
                logits, bias = soft_capped(base[:, k], shared.softcap), None
            else:
                logits, bias, state = self.position_logits(
                    base[:, k], hidden[:, k], prev, state, shared.softcap, w2
                )  # fmt: skip
            step = sample_step(logits, bias, temperature, u[:, k])
            prev = shared.target_ids(step.tokens)
            tokens.append(prev)
            probs.append(step.probs)
        tokens = torch.stack(tokens, 1)
        return tokens, torch.stack(probs, 1), self.confidence_pass(hidden, anchor, tokens)

    def position_logits(
        self, base: Tensor, h: Tensor, prev: Tensor, state, softcap: float | None,
        bias_weight: Tensor | None = None,
    ):  # fmt: skip
        """One position: the LM head's logits ``base`` [R, V], the backbone's hidden state ``h``
        [R, d] and the token before ``prev`` [R] -> (logits, bias or None, the head's new state):
        what ``sample_step`` draws from. ``bias_weight``: W2's rows of a draft vocabulary
        (``vocab_bias_weight``; None: W2), whose K columns ``base`` then has."""
        bias = None
        if self.head is not None:
            b, state = self.head.step(h, prev, state)
            bias = self.head.bias_logits(b) if bias_weight is None else F.linear(b, bias_weight)
        if softcap:  # the cap applies to the sum: add first
            return soft_capped(base.float() + (0.0 if bias is None else bias.float()), softcap), None, state
        return base, bias, state

    def head_step(self, h: Tensor, prev: Tensor, state):
        """The sequential head's step alone: (bias features b [R, r], new state); its bias logits
        are W2 b (``kernels.bias_argmax`` takes b to the greedy token)."""
        return self.head.step(h, prev, state)

    def position_argmax(
        self, base: Tensor, h: Tensor, prev: Tensor, state, softcap: float | None,
        bias_weight: Tensor | None = None,
    ):  # fmt: skip
        """``position_logits`` and then the greedy token [R]: the argmax of the float32 logits plus
        bias, what ``sample_step`` takes at T = 0 (ties to the lowest index; ``greedy_tokens``: the
        compiled step's reduction in vocabulary slices, many programs a row at one row); an index
        into the draft vocabulary where there is one."""
        logits, bias, state = self.position_logits(base, h, prev, state, softcap, bias_weight)
        z = logits.float() if bias is None else logits.float() + bias.float()
        return greedy_tokens(z), state

    def confidence_pass(self, hidden: Tensor, anchor: Tensor, tokens: Tensor) -> Tensor | None:
        """Confidence logits [R, n] (float32) of hidden [R, n, d] with the drafted tokens [R, n]."""
        # [anchor, tokens][:-1] rather than [anchor, tokens[:-1]]: no size n - 1, which a compiled
        # graph would specialise at n = 2.
        conf = self._confidence(hidden, torch.cat([anchor[:, None], tokens], dim=1)[:, :-1])
        return None if conf is None else conf.float()

    # ---- the fused paths (draft_step.FusedDraft) ---------------------------------------------
    position_major = True  # draft_hidden's output [γ, R, d]: each position's rows contiguous

    def confidence_by_position(self, hidden: Tensor, anchor: Tensor, tokens: Tensor) -> Tensor | None:
        """``confidence_pass`` of position-major hidden states [n, R, d]."""
        return self.confidence_pass(hidden.transpose(0, 1), anchor, tokens)

    def sample_block_fused(self, hidden, anchor, shared, temperature, u, fused):
        """``sample_block`` of the first n positions of position-major ``hidden`` [γ, R, d], with
        the head's step and the confidences compiled (``fused.position``, ``fused.confidence``) and
        each position's probabilities written into the proposal's buffer. The confidences run over
        the whole block (the tokens past n padded; a position's confidence reads only its own
        hidden state and the token before it), so their graph does not depend on n. At T = 0 each
        position is one compiled graph to its argmax (``fused.argmax``) and there are no
        probabilities (None): greedy verification reads tokens only."""
        r, n = u.shape
        gamma = hidden.shape[0]
        first = hidden[:n]  # [n, R, d]; at R = 1 its strides need not chain (see head_product)
        base = head_product(first, shared.lm_weight)  # [n, R, V]: one GEMM, also at R = 1
        greedy = temperature == 0
        probs = None if greedy else base.new_empty((r, n, base.shape[-1]), dtype=torch.float32)
        w2 = self.vocab_bias_weight(shared)
        state = self.head.init_state(r, first) if self.head is not None else None
        prev, tokens = anchor, []
        for k in range(n):
            logits, bias, h = base[k], None, first[k]
            if k < self.head_skip:  # the backbone's logits alone, as DFlash drafts
                logits = soft_capped(logits, shared.softcap)
                if greedy:
                    index = greedy_tokens(logits.float())
                else:
                    index = sample_step(logits, None, temperature, u[:, k], out=probs[:, k]).tokens
            elif greedy:
                index, state = fused.greedy_step(logits, h, prev, state, shared.softcap, w2)
            else:
                if self.head is not None or shared.softcap:
                    logits, bias, state = fused.step(logits, h, prev, state, shared.softcap, bias_weight=w2)
                index = sample_step(logits, bias, temperature, u[:, k], out=probs[:, k]).tokens
            prev = shared.target_ids(index)
            tokens.append(prev)
        if self.confidence is None:
            return torch.stack(tokens, 1), probs, None
        block = torch.stack(tokens + [anchor] * (gamma - n), 1)  # [R, γ]: the drafted tokens, padded
        fused.mark(hidden, 1)
        fused.mark(anchor, 0)
        fused.mark(block, 0)
        return block[:, :n], probs, fused.confidence(hidden, anchor, block)[:, :n]
