"""Training objectives (§3.3): position-weighted CE, TV distance to the target, and confidence BCE
against the analytical acceptance c* = 1 - ½‖p_d - p_t‖₁; Eagle3's step-weighted forward KL.

Target distributions come only at the sampled rows, from the target's last hidden states through
its frozen LM head: full-vocabulary target logits are never stored. With a draft vocabulary (the
K most frequent answer tokens, ``draft_vocab``) both distributions cover its K tokens alone.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from dspark.kernels.fused_loss import DraftLoss, RowWeights, fused_draft_loss, materialized_draft_loss

from .core.errors import ConfigError
from .core.phases import phase
from .core.schema import Count, NonNegative, Positive, check
from .core.types import DraftOutput

CPU_MATERIALIZE_BYTES = 1 << 30


@dataclass
class LossWeights:
    """conf/loss/*.yaml, checked (dspark.core.schema): block drafters weigh ce / tv / kl / confidence,
    Eagle3 kl with step_weight; every weight finite and >= 0. ``kl`` (forward KL to the target,
    KL(p_t ‖ p_d)) left out is the kind's own: 1 for Eagle3, 0 for a block drafter (the paper's
    eq. 12 has none; a weight > 0 is an ablation of its distribution-matching term)."""

    ce: NonNegative = 0.1
    tv: NonNegative = 0.9
    confidence: NonNegative = 1.0
    # w_k = exp(-(k-1)/gamma_decay); None: the block's own γ, the paper's eq. as written (DeepSpec uses 4)
    gamma_decay: Positive | None = 4.0
    impl: Literal["auto", "torch", "triton", "materialized"] = "auto"
    chunk_rows: Count | None = None  # rows per fused-loss chunk (None: sized from the vocabulary)
    kind: Literal["block", "eagle3"] = "block"
    kl: NonNegative | None = None
    step_weight: Positive = 0.8

    def __post_init__(self):
        if self.kl is None:
            self.kl = 1.0 if self.kind == "eagle3" else 0.0
        used = {"ce": self.ce, "tv": self.tv, "kl": self.kl, "confidence": self.confidence}
        if self.kind == "eagle3":
            used = {"kl": self.kl}
        if not any(used.values()):
            raise ConfigError(f"{' and '.join(used)} are all 0: nothing to train on (give one a weight > 0)")

    @classmethod
    def from_cfg(cls, cfg) -> LossWeights:
        return check(cfg, cls, "loss")


def position_weights(gamma: int, decay: float | None, device=None) -> Tensor:
    """w_k = exp(-(k-1)/decay) for k = 1..γ: earlier positions matter more under prefix acceptance.
    ``decay`` None: γ itself, so that a longer block keeps weight on its later positions."""
    return torch.exp(-torch.arange(gamma, device=device, dtype=torch.float32) / (decay or gamma))


class _StackedHead:
    """[W_lm | W2] in the LM head's dtype, for the fused loss: the frozen columns are copied once
    per LM head (and again only if it changes), the trainable ones on every call (V × r, cheap).
    The head is known by a weak reference as well as its address: a new tensor at a freed one's
    address (a draft vocabulary's rows, sliced per step) is another head."""

    def __init__(self):
        self.key = None
        self.source = lambda: None  # a weak reference to the head the frozen columns came from
        self.buffer: Tensor | None = None

    def __call__(self, lm_weight: Tensor, bias_weight: Tensor) -> Tensor:
        v, d = lm_weight.shape
        key = (lm_weight.data_ptr(), lm_weight._version, v, d, bias_weight.shape[1], lm_weight.dtype)
        stale = key != self.key or self.source() is not lm_weight
        if stale or self.buffer is None or self.buffer.device != lm_weight.device:
            self.buffer = lm_weight.new_empty(v, d + bias_weight.shape[1])
            self.buffer[:, :d] = lm_weight.detach()
            self.key, self.source = key, weakref.ref(lm_weight)
        with torch.no_grad():
            self.buffer[:, d:] = bias_weight
        return self.buffer


_stacked_head = _StackedHead()


def draft_target_distances(
    x: Tensor,
    lm_weight: Tensor,
    bias_weight: Tensor | None,
    th: Tensor,
    labels: Tensor,
    row_weights: RowWeights,
    softcap,
    impl: str,
    chunk_rows: int | None = None,
    target_index: Tensor | None = None,
    group_rows: int | None = None,
) -> DraftLoss:
    """The weighted loss and per-row CE, ‖p_d - p_t‖₁ and KL(p_t ‖ p_d) of draft logits
    x @ [W_lm | bias_weight]ᵀ against the target's th @ W_lmᵀ (row r's target th[r], or
    th[target_index[r]]; group_rows: see fused_draft_loss)."""
    n, v = x.shape[0], lm_weight.shape[0]
    if impl == "auto" and x.device.type == "cpu" and n * v * 4 < CPU_MATERIALIZE_BYTES:
        impl = "materialized"  # small CPU problems: full logits are cheaper than chunking them
    if impl == "materialized":
        weight = (
            lm_weight if bias_weight is None else torch.cat([lm_weight.to(bias_weight.dtype), bias_weight], 1)
        )
        return materialized_draft_loss(
            x.to(weight.dtype), weight, th.to(weight.dtype), labels, row_weights, softcap, target_index
        )
    weight = lm_weight if bias_weight is None else _stacked_head(lm_weight, bias_weight)
    return fused_draft_loss(
        x,
        weight,
        th,
        labels,
        row_weights,
        trainable=bias_weight,
        softcap=softcap,
        impl=impl,
        chunk_rows=chunk_rows,
        target_index=target_index,
        group_rows=group_rows,
    )


def restrict_to_vocab(
    lm_weight: Tensor, bias_weight: Tensor | None, labels: Tensor, vocab: Tensor | None
) -> tuple[Tensor, Tensor | None, Tensor]:
    """The LM head's rows, the trainable bias's rows and the labels of a loss over the draft
    vocabulary ``vocab`` ([K] sorted target ids; None: the whole vocabulary, unchanged). Labels
    become positions in it, -1 (no CE) for a token outside. The target's distribution is then its
    renormalisation over the K tokens: for a drafter that can draft only them, the distribution
    that maximises acceptance. What c* and τ_prob measure is acceptance within the vocabulary: a
    row's target mass outside it (1.4 % of SmolLM2's answer tokens at K = 16 384) is not counted
    against the drafter, so both read high by about that much."""
    if vocab is None:
        return lm_weight, bias_weight, labels
    at = torch.searchsorted(vocab, labels.clamp_min(0)).clamp_max(vocab.numel() - 1)
    labels = torch.where((labels >= 0) & (vocab[at] == labels), at, torch.full_like(labels, -1))
    bias = None if bias_weight is None else bias_weight.index_select(0, vocab)
    return lm_weight.index_select(0, vocab), bias, labels


def _flat_rows(out: DraftOutput, target_hidden: Tensor):
    """Every (sequence, anchor, k) row, valid or not (no host sync): features [N, K], the target
    hidden states [B·T, D] and the one each row is compared with (an index into them, [N]; a
    sequence's rows compare with its own positions only), labels (-1 where invalid), validity."""
    b, a, g = out.valid.shape
    t = target_hidden.shape[1]
    start = torch.arange(b, device=out.target_positions.device)[:, None] * t
    index = (out.target_positions.reshape(b, a * g) + start).reshape(-1)
    valid = out.valid.reshape(-1)
    labels = torch.where(valid, out.labels.reshape(-1), torch.full_like(valid, -1, dtype=out.labels.dtype))
    return out.features.reshape(b * a * g, -1), target_hidden.reshape(b * t, -1), index, labels, valid


def block_loss(
    out: DraftOutput, target_hidden: Tensor, target_lm_weight: Tensor, softcap, w: LossWeights,
    vocab: Tensor | None = None,
) -> dict:  # fmt: skip
    """DFlash / DSpark loss and its diagnostics (tensors on the device; nothing waits for the host).
    Returns a dict with 'loss' and the metrics. Invalid rows are computed with weight 0: they keep
    the shapes static, and every parameter still receives a (zero) gradient. ``vocab``: the draft
    vocabulary the loss covers (``restrict_to_vocab``; None: the whole)."""
    x, th, index, labels, valid = _flat_rows(out, target_hidden)
    lm_weight, bias_weight, labels = restrict_to_vocab(target_lm_weight, out.bias_weight, labels, vocab)
    gamma = out.valid.shape[-1]
    rows_per_sequence = x.shape[0] // max(1, out.valid.shape[0])
    pw = (position_weights(gamma, w.gamma_decay, x.device) * out.valid).reshape(-1)  # w_k, 0 if invalid
    norm = pw.sum().clamp_min(1e-12)
    unit = pw / norm
    weights = RowWeights(ce=w.ce * unit, tv=w.tv * unit, kl=w.kl * unit)
    with phase("fused_loss"):
        res = draft_target_distances(
            x, lm_weight, bias_weight, th, labels, weights, softcap, w.impl, w.chunk_rows, index,
            rows_per_sequence,
        )  # fmt: skip
    c_star = (1 - 0.5 * res.tv).clamp(0, 1) * valid
    loss = res.loss
    metrics = {"ce": (unit * res.ce).sum(), "tv": (unit * res.tv).sum()}
    if w.kl:
        metrics["kl"] = (unit * res.kl).sum()
    if out.confidence_logits is not None:
        with phase("confidence"):
            z = out.confidence_logits.reshape(-1).float()
            bce = F.binary_cross_entropy_with_logits(z, c_star, reduction="none")
            conf = (unit * bce).sum()
            loss = loss + w.confidence * conf
            pred = torch.sigmoid(z.detach())
            count = valid.sum().clamp_min(1)
            metrics.update(
                conf_loss=conf.detach(),
                conf_abs_err=((pred - c_star).abs() * valid).sum() / count,
                conf_bias=((pred - c_star) * valid).sum() / count,
            )
    with phase("acceptance_metrics"):
        metrics.update(acceptance_metrics(c_star.view(out.valid.shape), out.valid))
    metrics.update(loss=loss, rows=valid.sum(), _c_star=c_star.view(out.valid.shape))
    return metrics


@torch.no_grad()  # diagnostics, never differentiated: no graph, and no detach per output
def acceptance_metrics(c_star: Tensor, valid: Tensor) -> dict:
    """Mean c*_k per position and τ_prob = 1 + Σ_k Π_{i≤k} c*_i, the expected accepted length
    (with the bonus token) if the target sampled from these distributions. τ_prob averages over
    blocks whose γ positions are all inside the data, so end-of-sequence truncation does not bias
    it (blocks with only some valid positions serve when no block is whole). ``c_star`` [B, A, γ]
    is 0 where ``valid`` is False. Tensors only: no host sync."""
    flat_c, flat_v = (c_star.float() * valid).flatten(0, 1), valid.flatten(0, 1)
    den = flat_v.sum(0).float()
    pos_num = (flat_c * flat_v).sum(0)
    per_pos = pos_num / den.clamp(min=1)
    full = flat_v.all(-1).float()
    partial = flat_v[:, 0].float()
    prefix = flat_c.cumprod(-1).sum(-1)
    # Numerators and denominators, so τ_prob and c*_k over many batches (and ranks) are exact ratios
    # of sums, not means of per-batch means: [Σ_full Σ_k Π c*, #full, Σ_partial Σ_k Π c*, #partial].
    tau_sums = torch.stack([(prefix * full).sum(), full.sum(), (prefix * partial).sum(), partial.sum()])
    use_full = tau_sums[1] > 0
    num = torch.where(use_full, tau_sums[0], tau_sums[2])
    cnt = torch.where(use_full, tau_sums[1], tau_sums[3])
    out = {"tau_prob": 1 + num / cnt.clamp(min=1), "acceptance_blocks": cnt}
    out.update({f"c_star_{i + 1}": p for i, p in enumerate(per_pos.unbind(0))})  # one operator for all γ
    out["_tau_sums"] = tau_sums
    out["_pos_sums"] = torch.stack([pos_num, den])  # [2, γ]
    return out


def eagle3_loss(
    out: DraftOutput, target_hidden: Tensor, target_lm_weight: Tensor, softcap, w: LossWeights,
    vocab: Tensor | None = None,
) -> dict:  # fmt: skip
    """Forward KL(p_t ‖ p_d) at every TTT step, step i weighted step_weight^i (CE and TV are
    reported, not trained on). Same fused loss as the block drafters, with weight on KL only."""
    x, th, index, labels, valid = _flat_rows(out, target_hidden)
    lm_weight, bias_weight, labels = restrict_to_vocab(target_lm_weight, out.bias_weight, labels, vocab)
    gamma = out.valid.shape[-1]
    rows_per_sequence = x.shape[0] // max(1, out.valid.shape[0])
    steps = w.step_weight ** torch.arange(gamma, device=x.device, dtype=torch.float32)
    sw = (steps * out.valid).reshape(-1)
    unit = sw / sw.sum().clamp_min(1e-12)
    zero = torch.zeros_like(unit)
    with phase("fused_loss"):
        res = draft_target_distances(
            x, lm_weight, bias_weight, th, labels, RowWeights(ce=zero, tv=zero, kl=w.kl * unit), softcap,
            w.impl, w.chunk_rows, index, rows_per_sequence,
        )  # fmt: skip
    c_star = (1 - 0.5 * res.tv).clamp(0, 1) * valid
    metrics = {
        "loss": res.loss,
        "kl": (unit * res.kl).sum(),
        "ce": (unit * res.ce).sum(),
        "tv": (unit * res.tv).sum(),
    }
    metrics.update(acceptance_metrics(c_star.view(out.valid.shape), out.valid))
    metrics["rows"] = valid.sum()
    return metrics


def compute_loss(
    out: DraftOutput, target_hidden, target_lm_weight, softcap, w: LossWeights, vocab: Tensor | None = None
) -> dict:
    loss = eagle3_loss if w.kind == "eagle3" else block_loss
    return loss(out, target_hidden, target_lm_weight, softcap, w, vocab)


__all__ = [
    "LossWeights",
    "position_weights",
    "block_loss",
    "eagle3_loss",
    "compute_loss",
    "acceptance_metrics",
    "restrict_to_vocab",
]
