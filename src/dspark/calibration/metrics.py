"""Per-position calibration metrics for drafter confidence heads (DSpark §3.2.1, Fig. 6).

Inputs follow one convention for both kinds of observations:
``logits [N, γ]`` (confidence logits z_k), ``labels [N, γ]`` in [0, 1] (binary prefix-acceptance
indicators from engine rollouts, or soft cumulative labels Π c*_i from teacher-forced batches) and
``valid [N, γ]`` (bool). Everything is measured on the *cumulative* prediction a_k = Π_{i≤k} c_i,
because that is the quantity the prefix scheduler consumes.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor
from torchmetrics.functional.classification import binary_auroc, binary_calibration_error

__all__ = [
    "ReliabilityBins",
    "ece_noise_floor",
    "expected_calibration_error",
    "position_metrics",
    "reliability_bins",
    "reliability_data",
    "summary",
]


def _is_binary(label: Tensor) -> bool:
    return bool(((label == 0) | (label == 1)).all())


def _bin_boundaries(n_bins: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    # Same construction as torchmetrics, so bucketing (including float rounding of the edges) agrees.
    return torch.linspace(0, 1, n_bins + 1, dtype=dtype, device=device)


def _ece_l1(pred: Tensor, label: Tensor, n_bins: int) -> Tensor:
    """Equal-width-bin L1 ECE along the last dim; ``pred`` may carry leading batch dims.

    Uses torchmetrics' bucketing: ``bucketize(p, linspace(0, 1, n+1), right=True) - 1``, which gives
    n+1 slots (p == 1.0 exactly gets its own). Since count_b/M * |mean_p - mean_y| = |Σp - Σy|_b / M,
    the ECE is Σ_b |Σ_b (p - y)| / M, with no per-bin division (empty bins contribute 0).
    """
    m = pred.shape[-1]
    if m == 0:
        return torch.full(pred.shape[:-1], float("nan"), dtype=pred.dtype, device=pred.device)
    idx = torch.bucketize(pred, _bin_boundaries(n_bins, pred.dtype, pred.device), right=True) - 1
    diff = (pred - label.to(pred.dtype)).expand_as(pred)
    gap = torch.zeros(*pred.shape[:-1], n_bins + 1, dtype=pred.dtype, device=pred.device)
    gap.scatter_add_(-1, idx, diff)
    return gap.abs().sum(-1) / m


def expected_calibration_error(pred: Tensor, label: Tensor, n_bins: int = 15) -> float:
    """L1 ECE with ``n_bins`` equal-width bins over [0, 1]; NaN for empty input.

    Binary labels go through ``torchmetrics``' ``binary_calibration_error`` (norm="l1"). Soft labels
    (values strictly inside (0, 1), e.g. Π c*_i) are not accepted there, so the same definition —
    Σ_b (n_b/N)·|mean pred_b − mean label_b| with identical bucketing — is computed directly. The
    two agree on binary labels up to float rounding (tested).
    """
    pred = pred.reshape(-1).float()
    label = label.reshape(-1)
    if pred.numel() == 0:
        return float("nan")
    if _is_binary(label):
        return float(binary_calibration_error(pred, label.long(), n_bins=n_bins, norm="l1"))
    return float(_ece_l1(pred, label.float(), n_bins))


def ece_noise_floor(pred: Tensor, n_bins: int = 15) -> float:
    """The ECE that perfectly calibrated confidences ``pred`` would show at this sample size, on
    average: with labels drawn independently as Bernoulli(p), a bin's error |Σ (p - y)| is about
    normal with variance Σ p(1 - p), so its mean is sqrt(2/π · Σ p(1 - p)); the floor is their sum
    over the bins (the ECE's bucketing) over the count. An ECE near it is as good as this many
    samples can show (rounds of one request are correlated: the real noise is higher); NaN for
    empty input."""
    pred = pred.reshape(-1).double()
    if pred.numel() == 0:
        return float("nan")
    idx = torch.bucketize(pred, _bin_boundaries(n_bins, pred.dtype, pred.device), right=True) - 1
    var = torch.zeros(n_bins + 1, dtype=pred.dtype, device=pred.device).scatter_add_(
        0, idx, pred * (1 - pred)
    )
    return float((var * (2 / math.pi)).sqrt().sum() / pred.numel())


def _check_inputs(logits: Tensor, labels: Tensor, valid: Tensor) -> None:
    if logits.dim() != 2 or logits.shape != labels.shape or logits.shape != valid.shape:
        raise ValueError(
            f"expected logits, labels, valid of equal shape [N, gamma]; got "
            f"{tuple(logits.shape)}, {tuple(labels.shape)}, {tuple(valid.shape)}"
        )
    if valid.dtype != torch.bool:
        raise TypeError(f"valid must be a bool tensor, got {valid.dtype}")
    vl = labels[valid]
    # Labels outside the mask may be padding (-1, NaN); only the masked ones must be probabilities.
    if vl.numel() and not bool(((vl >= 0) & (vl <= 1)).all()):
        raise ValueError("labels must lie in [0, 1] wherever valid is True")


def _auroc(pred: Tensor, label: Tensor) -> float:
    target = (label >= 0.5).long()
    if pred.numel() == 0 or int(target.min()) == int(target.max()):
        return float("nan")  # undefined with a single class
    return float(binary_auroc(pred.float(), target))


def _calibrated(logits: Tensor, calibration) -> tuple[Tensor | None, list[float], list[float] | None]:
    """(a_k after ``calibration``, its temperatures, its offsets): ``calibration`` is a
    ``Calibration`` (STS, or STS with offsets), bare STS temperatures, or None (raw: no a_k)."""
    from dspark.calibration.sts import Calibration, cumulative_confidence  # sts imports this module

    calibration = Calibration.of(calibration)
    if calibration is None:
        return None, [1.0] * logits.shape[1], None
    temps, offsets = calibration.temperatures, calibration.offsets
    return cumulative_confidence(logits, temps, offsets), temps, offsets


def position_metrics(
    logits: Tensor,
    labels: Tensor,
    valid: Tensor,
    calibration=None,
    n_bins: int = 15,
) -> list[dict]:
    """Metrics of the cumulative prediction at each draft position k = 1..γ (list index k-1).

    ``calibration``: a ``Calibration`` (STS, or STS with offsets), bare STS temperatures, or None.
    Keys: ``position`` (1-based), ``count``, ``temperature`` (1.0 when none given; ``offset`` too
    for STS with offsets), ``ece_raw``, ``brier_raw``, ``auroc`` (raw cumulative vs label ≥ 0.5;
    NaN with one class) and, with a calibration, ``ece_sts``, ``brier_sts``, ``auroc_sts`` (the
    calibrated a_k, whichever the method); with binary labels, ``ece_raw_floor`` (``ece_sts_floor``):
    the ECE perfectly calibrated raw (calibrated) confidences would show here (``ece_noise_floor``).
    Positions with no valid data report NaN. Note: at k = 1 STS cannot change AUROC (monotone in
    z_1); for k ≥ 2 the cumulative product mixes positions with different temperatures, so its
    *cross-sample* ranking — hence ``auroc_sts`` — may move slightly, although each c_k's ranking is
    preserved.
    """
    from dspark.calibration.sts import cumulative_confidence  # sts imports this module

    _check_inputs(logits, labels, valid)
    raw = cumulative_confidence(logits)
    sts, temps, offsets = _calibrated(logits, calibration)
    out = []
    for k in range(logits.shape[1]):
        m = valid[:, k]
        y = labels[:, k][m].float()
        p = raw[:, k][m]
        row = {
            "position": k + 1,
            "count": int(m.sum()),
            "temperature": float(temps[k]),
            **({} if offsets is None else {"offset": float(offsets[k])}),
            "ece_raw": expected_calibration_error(p, y, n_bins),
            "brier_raw": float(((p - y) ** 2).mean()) if y.numel() else float("nan"),
            "auroc": _auroc(p, y),
        }
        binary = _is_binary(y)  # soft labels carry no Bernoulli noise: no floor to state
        if binary:
            row["ece_raw_floor"] = ece_noise_floor(p, n_bins)
        if sts is not None:
            q = sts[:, k][m]
            row["ece_sts"] = expected_calibration_error(q, y, n_bins)
            if binary:
                row["ece_sts_floor"] = ece_noise_floor(q, n_bins)
            row["brier_sts"] = float(((q - y) ** 2).mean()) if y.numel() else float("nan")
            row["auroc_sts"] = _auroc(q, y)
        out.append(row)
    return out


_SUMMARY_KEYS = (
    "ece_raw",
    "ece_sts",
    "ece_raw_floor",
    "ece_sts_floor",
    "auroc",
    "auroc_sts",
    "brier_raw",
    "brier_sts",
)


def summary(per_position: list[dict]) -> dict:
    """Plain (unweighted) mean over positions that have data, ignoring NaNs.

    Plain rather than count-weighted: later positions see far fewer samples (they need every earlier
    token accepted), and weighting by count would let position 1 dominate the headline — the paper
    likewise quotes the average over positions.
    """

    def mean(key: str) -> float:
        vals = [r[key] for r in per_position if r.get("count", 0) > 0 and key in r]
        vals = [v for v in vals if not math.isnan(v)]
        return sum(vals) / len(vals) if vals else float("nan")

    out = {"positions": sum(1 for r in per_position if r.get("count", 0) > 0)}
    for key in _SUMMARY_KEYS:
        if any(key in r for r in per_position):
            out[f"{key}_mean"] = mean(key)
    return out


class ReliabilityBins(NamedTuple):
    """Per-bin data of a reliability curve; empty bins hold NaN means and count 0."""

    centers: Tensor
    mean_pred: Tensor
    mean_label: Tensor
    counts: Tensor

    def to_dict(self) -> dict:
        def lst(t: Tensor) -> list:
            return [None if math.isnan(v) else v for v in t.double().tolist()]  # NaN is not JSON

        return {
            "centers": lst(self.centers),
            "mean_pred": lst(self.mean_pred),
            "mean_label": lst(self.mean_label),
            "counts": [int(c) for c in self.counts.tolist()],
        }


def reliability_bins(pred: Tensor, label: Tensor, n_bins: int = 15) -> ReliabilityBins:
    """Equal-width bins over [0, 1] for plotting; p == 1.0 is folded into the last bin."""
    pred = pred.reshape(-1).double()
    label = label.reshape(-1).double()
    edges = _bin_boundaries(n_bins, torch.float64, pred.device)
    idx = (torch.bucketize(pred, edges, right=True) - 1).clamp_(0, n_bins - 1)
    counts = torch.zeros(n_bins, dtype=torch.float64).scatter_add_(0, idx, torch.ones_like(pred))
    sp = torch.zeros(n_bins, dtype=torch.float64).scatter_add_(0, idx, pred)
    sl = torch.zeros(n_bins, dtype=torch.float64).scatter_add_(0, idx, label)
    nz = counts > 0
    nan = torch.full_like(counts, float("nan"))
    return ReliabilityBins(
        centers=(edges[:-1] + edges[1:]) / 2,
        mean_pred=torch.where(nz, sp / counts.clamp_min(1), nan),
        mean_label=torch.where(nz, sl / counts.clamp_min(1), nan),
        counts=counts.long(),
    )


def reliability_data(
    logits: Tensor,
    labels: Tensor,
    valid: Tensor,
    calibration=None,
    n_bins: int = 15,
) -> list[dict]:
    """Per-position JSON-ready input for ``plots.reliability_diagram``.

    Each entry: the ``position_metrics`` row plus ``raw`` (and ``sts`` with a calibration, as
    ``position_metrics`` takes it) ``ReliabilityBins.to_dict()``; NaN metrics become None so the
    list serialises as strict JSON.
    """
    from dspark.calibration.sts import cumulative_confidence

    rows = position_metrics(logits, labels, valid, calibration, n_bins)
    raw = cumulative_confidence(logits)
    sts = _calibrated(logits, calibration)[0]
    for k, row in enumerate(rows):
        for key, v in list(row.items()):
            if isinstance(v, float) and math.isnan(v):
                row[key] = None
        m = valid[:, k]
        y = labels[:, k][m]
        row["raw"] = reliability_bins(raw[:, k][m], y, n_bins).to_dict()
        if sts is not None:
            row["sts"] = reliability_bins(sts[:, k][m], y, n_bins).to_dict()
    return rows
