"""Training objectives (§3.3): position-weighted CE, TV distance to the target, and confidence BCE
against the analytical acceptance c* = 1 - ½‖p_d - p_t‖₁; Eagle3's step-weighted forward KL.

Target distributions come only at the sampled rows, from the target's last hidden states through
its frozen LM head: full-vocabulary target logits are never stored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from dspark.kernels.fused_loss import fused_draft_loss, materialized_draft_loss

from .core.types import DraftOutput

CPU_MATERIALIZE_BYTES = 1 << 30


@dataclass
class LossWeights:
    ce: float = 0.1
    tv: float = 0.9
    confidence: float = 1.0
    gamma_decay: float = 4.0
    impl: str = "auto"  # auto | torch | triton | materialized
    chunk_size: int = 8192
    kind: str = "block"
    kl: float = 1.0
    step_weight: float = 0.8

    @classmethod
    def from_cfg(cls, cfg) -> LossWeights:
        fields = cls.__dataclass_fields__
        return cls(**{k: v for k, v in dict(cfg).items() if k in fields})


def position_weights(gamma: int, decay: float, device=None) -> Tensor:
    """w_k = exp(-(k-1)/decay) for k = 1..γ: earlier positions matter more under prefix acceptance."""
    return torch.exp(-torch.arange(gamma, device=device, dtype=torch.float32) / decay)


def _rows(out: DraftOutput, target_hidden: Tensor):
    """Flatten the valid (sequence, anchor, k) rows and gather their target hidden states."""
    valid = out.valid
    b, a, g = valid.shape
    idx = out.target_positions.flatten(1)  # [B, A·γ]
    th = torch.gather(target_hidden, 1, idx[..., None].expand(-1, -1, target_hidden.shape[-1])).view(
        b, a, g, -1
    )
    k = torch.arange(g, device=valid.device).expand(b, a, g)
    return out.features[valid], th[valid], out.labels[valid], k[valid]


def draft_target_distances(x, weight, th, tw, labels, softcap, impl: str, chunk: int):
    """Per-row CE and ‖p_d - p_t‖₁."""
    th = th.to(tw.dtype)
    if x.dtype != weight.dtype:
        weight = weight.to(x.dtype)
    if impl == "auto" and x.device.type == "cpu" and x.shape[0] * weight.shape[0] * 4 < CPU_MATERIALIZE_BYTES:
        impl = "materialized"  # on CPU the chunked path trades 2-3x time for memory we do not need here
    if impl == "materialized":
        return materialized_draft_loss(x, weight, th, tw, labels, softcap)
    return fused_draft_loss(x, weight, th, tw, labels, softcap, chunk=chunk, impl=impl)


def block_loss(
    out: DraftOutput, target_hidden: Tensor, target_lm_weight: Tensor, softcap, w: LossWeights
) -> dict:
    """DFlash / DSpark loss and its diagnostics. Returns a dict with 'loss' and float metrics."""
    x, th, labels, k = _rows(out, target_hidden)
    gamma = out.valid.shape[-1]
    if x.shape[0] == 0:
        zero = out.features.sum() * 0
        return {"loss": zero, "rows": 0}
    res = draft_target_distances(x, out.weight, th, target_lm_weight, labels, softcap, w.impl, w.chunk_size)
    pw = position_weights(gamma, w.gamma_decay, x.device)[k]
    norm = pw.sum()
    ce = (pw * res.ce).sum() / norm
    tv = (pw * res.tv).sum() / norm
    c_star = (1 - 0.5 * res.tv).detach().clamp(0, 1)
    loss = w.ce * ce + w.tv * tv
    metrics = {"ce": ce.detach(), "tv": tv.detach()}
    if out.confidence_logits is not None:
        z = out.confidence_logits[out.valid].float()
        bce = F.binary_cross_entropy_with_logits(z, c_star, reduction="none")
        conf = (pw * bce).sum() / norm
        loss = loss + w.confidence * conf
        pred = torch.sigmoid(z.detach())
        metrics.update(
            conf_loss=conf.detach(),
            conf_abs_err=(pred - c_star).abs().mean(),
            conf_bias=(pred - c_star).mean(),
        )
    metrics.update(acceptance_metrics(c_star, out.valid))
    metrics.update(loss=loss, rows=int(x.shape[0]), _c_star=c_star)
    return metrics


def acceptance_metrics(c_star_rows: Tensor, valid: Tensor) -> dict:
    """Mean c*_k per position and τ_prob = 1 + Σ_k Π_{i≤k} c*_i, the expected accepted length
    (with the bonus token) if the target sampled from these distributions. τ_prob averages over
    blocks whose γ positions are all inside the data, so end-of-sequence truncation does not bias it."""
    gamma = valid.shape[-1]
    c = torch.zeros(valid.shape, device=valid.device)
    c[valid] = c_star_rows.float()
    flat_c, flat_v = c.flatten(0, 1), valid.flatten(0, 1)
    per_pos = (flat_c * flat_v).sum(0) / flat_v.sum(0).clamp(min=1)
    full = flat_v.all(-1)
    blocks = flat_c[full] if full.any() else flat_c[flat_v[:, 0]]
    tau = 1 + blocks.cumprod(-1).sum(-1).mean() if blocks.numel() else torch.tensor(1.0)
    out = {"tau_prob": tau.detach(), "acceptance_blocks": int(blocks.shape[0])}
    out.update({f"c_star_{i + 1}": per_pos[i].detach() for i in range(gamma)})
    # Numerators and denominators, so τ_prob and c*_k over many batches (and ranks) are exact ratios
    # of sums, not means of per-batch means: [Σ_full Σ_k Π c*, #full, Σ_partial Σ_k Π c*, #partial].
    partial = flat_v[:, 0]
    out["_tau_sums"] = torch.stack(
        [
            flat_c[full].cumprod(-1).sum(),
            full.sum().float(),
            flat_c[partial].cumprod(-1).sum(),
            partial.sum().float(),
        ]
    ).detach()
    out["_pos_sums"] = torch.stack([(flat_c * flat_v).sum(0), flat_v.sum(0).float()]).detach()  # [2, γ]
    return out


def eagle3_loss(
    out: DraftOutput, target_hidden: Tensor, target_lm_weight: Tensor, softcap, w: LossWeights
) -> dict:
    """Forward KL(p_t ‖ p_d) at every TTT step, step i weighted step_weight^i."""
    x, th, labels, k = _rows(out, target_hidden)
    if x.shape[0] == 0:
        return {"loss": out.features.sum() * 0, "rows": 0}
    gamma = out.valid.shape[-1]
    sw = torch.tensor([w.step_weight**i for i in range(gamma)], device=x.device)[k]
    logits_d = x @ out.weight.t().to(x.dtype)
    logits_t = th.to(target_lm_weight.dtype) @ target_lm_weight.t()
    if softcap:
        logits_d = torch.tanh(logits_d / softcap) * softcap
        logits_t = torch.tanh(logits_t / softcap) * softcap
    logp_d = torch.log_softmax(logits_d.float(), -1)
    with torch.no_grad():
        logp_t = torch.log_softmax(logits_t.float(), -1)
        p_t = logp_t.exp()
    kl = (p_t * (logp_t - logp_d)).sum(-1)
    loss = w.kl * (sw * kl).sum() / sw.sum()
    with torch.no_grad():
        tv = (logp_d.exp() - p_t).abs().sum(-1)
        ce = -logp_d.gather(1, labels[:, None]).squeeze(1)
    metrics = {
        "loss": loss,
        "kl": kl.detach().mean(),
        "ce": (sw * ce).sum() / sw.sum(),
        "tv": (sw * tv).sum() / sw.sum(),
    }
    metrics.update(acceptance_metrics((1 - 0.5 * tv).clamp(0, 1), out.valid))
    metrics["rows"] = int(x.shape[0])
    return metrics


def compute_loss(out: DraftOutput, target_hidden, target_lm_weight, softcap, w: LossWeights) -> dict:
    if w.kind == "eagle3":
        return eagle3_loss(out, target_hidden, target_lm_weight, softcap, w)
    return block_loss(out, target_hidden, target_lm_weight, softcap, w)


__all__ = [
    "LossWeights",
    "position_weights",
    "block_loss",
    "eagle3_loss",
    "compute_loss",
    "acceptance_metrics",
]
