"""DSpark (§3.1–3.2): the DFlash backbone, a light sequential head that adds a prefix-dependent
low-rank bias to each position's logits, and a confidence head predicting prefix survival."""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.errors import ConfigError
from ..core.types import TargetDims
from ..kernels.sample_step import sample_step
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
        conf = cfg.get("confidence") or {}
        self.confidence = None
        if self.config_has_confidence(cfg):
            prev_dim = self.head.rank if self.head is not None and conf.get("use_prev_embedding", True) else 0
            self.confidence = ConfidenceHead(dims.hidden_size, prev_dim)

    @classmethod
    def check_config(cls, drafter_cfg, head_cfg) -> None:
        head = head_cfg.name if head_cfg is not None else "none"
        if head not in (*HEADS, "none"):
            raise ConfigError(f"head.name '{head}' is not one of {(*HEADS, 'none')}")
        if head != "none" and int(head_cfg.rank) <= 0:
            raise ConfigError(f"head.rank must be positive for head={head}, got {head_cfg.rank}")
        check_slots(drafter_cfg)

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
        return self.confidence(h, emb)

    def head_features(self, hidden, prev):
        conf = self._confidence(hidden, prev)
        if self.head is None:
            return hidden, conf
        return torch.cat([hidden, self.head.sequence(hidden, prev).to(hidden.dtype)], dim=-1), conf

    def bias_weight(self) -> Tensor | None:
        return None if self.head is None else self.head.W2.weight

    def sample_block(self, hidden, anchor, shared, temperature, u):
        """Left to right over the positions of ``hidden`` [R, n, d]: each position's exact
        distribution is conditioned on the token actually sampled before it, so verification
        against these probabilities stays lossless. One LM-head product for the n positions, then
        per position the head's bias and the fused softmax + inverse-CDF draw
        (``kernels.sample_step``; its PyTorch reference off CUDA). The confidences need only each
        position's hidden state and the token before it: one batched pass after the loop."""
        base = hidden @ shared.lm_weight.t().to(hidden.dtype)  # [R, n, V]; upcast in the sampler
        prev = anchor
        state = self.head.init_state(anchor.shape[0], hidden) if self.head is not None else None
        tokens, probs = [], []
        for k in range(hidden.shape[1]):
            h = hidden[:, k]
            logits, bias = base[:, k], None
            if self.head is not None:
                b, state = self.head.step(h, prev, state)
                bias = self.head.bias_logits(b)
            if shared.softcap:  # the cap applies to the sum: add first
                logits = logits.float() + (0.0 if bias is None else bias.float())
                logits, bias = torch.tanh(logits / shared.softcap) * shared.softcap, None
            step = sample_step(logits, bias, temperature, u[:, k])
            prev = step.tokens
            tokens.append(prev)
            probs.append(step.probs)
        tokens = torch.stack(tokens, 1)
        conf = self._confidence(hidden, torch.cat([anchor[:, None], tokens[:, :-1]], dim=1))
        return tokens, torch.stack(probs, 1), None if conf is None else conf.float()
