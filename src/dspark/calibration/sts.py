"""Sequential Temperature Scaling (STS, DSpark §3.2.1), and STS with offsets.

Each confidence c_k = σ(z_k) is conditional on the earlier draft tokens surviving, so the probability
that a length-k prefix is accepted is a_k = Π_{i≤k} σ(z_i / T_i). STS fits T_1, T_2, ... left to
right on held-out data: T_k is the grid point minimising the ECE of a_k with T_{<k} already fixed.
Positive temperatures keep each position's ranking of c_k intact.

A temperature only sharpens or flattens c_k around 1/2; it cannot lower confidences that are too high
across the whole range, which is what benchmark rounds show where the drafter's training data was
another distribution (at T = 1 the first position's acceptance runs at ≈ 0.88 × its confidence from
0.3 to 0.97, and STS's ECE search there ends at its largest temperature, flattening every c_1 toward
1/2). STS with offsets fits c_k = σ(z_k / T_k + b_k), left to right as STS does, each pair by the
log-loss of a_k; still monotone in z_k, so rankings are kept; b = 0 everywhere is STS's form.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.errors import DataError
from ..core.io import atomic_write_json, read_json
from .metrics import _check_inputs, _ece_l1, _is_binary

__all__ = [
    "Calibration",
    "cumulative_confidence",
    "default_grid",
    "fit_sts",
    "fit_sts_offsets",
]

# Bounds the [grid_chunk, M] candidate matrix built per position (16-32 MB).
_MAX_CHUNK_ELEMS = 1 << 22


def default_grid() -> Tensor:
    """200 log-spaced temperatures over [0.05, 20] plus T = 1 (identity), sorted, float64."""
    g = torch.logspace(math.log10(0.05), math.log10(20.0), 200, dtype=torch.float64)
    return torch.unique(torch.cat([g, torch.ones(1, dtype=torch.float64)]))


def cumulative_confidence(
    logits: Tensor,
    temperatures: Tensor | Sequence[float] | None = None,
    offsets: Tensor | Sequence[float] | None = None,
) -> Tensor:
    """a_k = Π_{i≤k} σ(z_i / T_i + b_i) over the last dim (b = 0 without ``offsets``), summed in log
    space so long products of small confidences don't underflow before the final exp. Returns
    float32 or wider."""
    # Half precision would lose the small log-probabilities of long prefixes.
    low = (torch.float16, torch.bfloat16)
    z = logits.float() if not logits.is_floating_point() or logits.dtype in low else logits
    if temperatures is not None:
        t = torch.as_tensor(temperatures, dtype=z.dtype, device=z.device)
        if t.shape != z.shape[-1:]:
            raise ValueError(f"need {z.shape[-1]} temperatures, got shape {tuple(t.shape)}")
        if not bool((t > 0).all()):
            raise ValueError("temperatures must be positive (order preservation)")
        z = z / t
    if offsets is not None:
        b = torch.as_tensor(offsets, dtype=z.dtype, device=z.device)
        if b.shape != z.shape[-1:]:
            raise ValueError(f"need {z.shape[-1]} offsets, got shape {tuple(b.shape)}")
        z = z + b
    return F.logsigmoid(z).cumsum(-1).exp()


def _best_temperature(base: Tensor, z: Tensor, y: Tensor, grid: Tensor, n_bins: int) -> float:
    """Grid point T minimising ECE(exp(base + logσ(z/T)), y); ties go to the T closest to 1."""
    m = z.numel()
    chunk = max(1, _MAX_CHUNK_ELEMS // max(m, 1))
    eces = []
    for g in grid.to(z.dtype).split(chunk):
        pred = (base + F.logsigmoid(z / g[:, None])).exp()  # [chunk, M]
        eces.append(_ece_l1(pred, y, n_bins))
    ece = torch.cat(eces)
    # Candidates within rounding of the minimum count as ties; taking the smallest |log T| among them
    # keeps the correction minimal and the choice independent of summation-order noise.
    near = ece <= ece.min() * (1 + 1e-5) + 1e-9
    dist = torch.where(near, grid.log().abs(), torch.full_like(grid, math.inf))
    return float(grid[int(torch.argmin(dist))])


def fit_sts(
    logits: Tensor,
    labels: Tensor,
    valid: Tensor,
    grid: Tensor | Sequence[float] | None = None,
    *,
    fixed: Sequence[float | None] | None = None,
    n_bins: int = 15,
) -> Tensor:
    """Fit per-position temperatures ``[γ]`` (float64) by sequential ECE grid search.

    ``labels``: binary prefix-acceptance indicators (engine rollouts: y_k = 1[n ≥ k], valid k ≤ ℓ) or
    soft cumulative labels Π_{i≤k} c*_i (teacher-forced batches) — the ECE handles both. Positions
    with no valid data keep T = 1. ``fixed[k]`` (when not None) pins T_{k+1} instead of searching it;
    later positions are then fitted on top of the pinned value, e.g. to refit a tail or to study how
    T_k depends on T_{<k}. The search runs on the inputs' device.
    """
    _check_inputs(logits, labels, valid)
    n, gamma = logits.shape
    grid = default_grid() if grid is None else torch.as_tensor(grid, dtype=torch.float64).flatten()
    grid = grid.to(logits.device)
    if grid.numel() == 0 or not bool((grid > 0).all()):
        raise ValueError("grid must be non-empty and strictly positive")
    fixed = list(fixed or [])
    if len(fixed) > gamma:
        raise ValueError(f"fixed has {len(fixed)} entries for gamma={gamma}")
    fixed += [None] * (gamma - len(fixed))

    # At least float32: float64 logsigmoid is ~7x slower on CPU and buys nothing at ECE resolution.
    dt = torch.promote_types(logits.dtype, torch.float32)
    z_all = logits.detach().to(dt)
    y_all = torch.where(valid, labels.detach().to(dt), torch.zeros((), dtype=dt))
    temps = torch.ones(gamma, dtype=torch.float64)
    log_prefix = torch.zeros(n, dtype=dt, device=z_all.device)  # Σ_{i<k} logσ(z_i/T_i), fitted T_i
    for k in range(gamma):
        m = valid[:, k]
        if fixed[k] is not None:
            if not fixed[k] > 0:
                raise ValueError(f"fixed temperature at position {k + 1} must be positive")
            temps[k] = float(fixed[k])
        elif bool(m.any()):
            temps[k] = _best_temperature(log_prefix[m], z_all[m, k], y_all[m, k], grid, n_bins)
        log_prefix += F.logsigmoid(z_all[:, k] / float(temps[k]))
    return temps


# STS with offsets is fitted by log-loss, not by the ECE: the ECE of a constant at the base rate is 0,
# so with a free offset an ECE search drifts to flat, uninformative confidences (a temperature at the
# grid's top and the offset matching the mean); the log-loss rewards ranking as well as calibration.
_TEMPERATURE_RANGE = (0.05, 20.0)  # STS's grid's range
_OFFSET_RANGE = (-8.0, 8.0)


def fit_sts_offsets(
    logits: Tensor, labels: Tensor, valid: Tensor, *, max_iter: int = 100
) -> tuple[Tensor, Tensor]:
    """STS with offsets: per-position temperatures and offsets ``([γ], [γ])`` (float64), left to right:
    (T_k, b_k) minimise the log-loss of a_k = a_{k-1} σ(z_k / T_k + b_k) with the earlier pairs fixed
    (L-BFGS; T within STS's grid range [0.05, 20], |b| ≤ 8). Labels as for ``fit_sts`` (binary or
    soft); a position with no valid data, or binary labels of one class only, keeps (1, 0)."""
    _check_inputs(logits, labels, valid)
    n, gamma = logits.shape
    z_all, y_all = logits.detach().double(), labels.detach().double()
    temps = torch.ones(gamma, dtype=torch.float64)
    offsets = torch.zeros(gamma, dtype=torch.float64)
    log_prefix = torch.zeros(n, dtype=torch.float64, device=z_all.device)  # Σ_{i<k} logσ(z_i/T_i + b_i)
    for k in range(gamma):
        m = valid[:, k]
        y = y_all[m, k]
        if y.numel() and not (_is_binary(y) and float(y.min()) == float(y.max())):  # one class: no fit
            temps[k], offsets[k] = _log_loss_pair(log_prefix[m], z_all[m, k], y, max_iter)
        log_prefix += F.logsigmoid(z_all[:, k] / float(temps[k]) + float(offsets[k]))
    return temps, offsets


def _log_loss_pair(base: Tensor, z: Tensor, y: Tensor, max_iter: int) -> tuple[float, float]:
    """(T, b) minimising the mean log-loss of exp(base + logσ(z/T + b)) against y; from (1, 0)."""
    log_scale = torch.zeros((), dtype=torch.float64, device=z.device, requires_grad=True)  # log(1/T)
    offset = torch.zeros((), dtype=torch.float64, device=z.device, requires_grad=True)
    opt = torch.optim.LBFGS([log_scale, offset], max_iter=max_iter, line_search_fn="strong_wolfe")

    def loss() -> Tensor:
        opt.zero_grad()
        log_a = (base + F.logsigmoid(z * log_scale.exp() + offset)).clamp(max=-1e-12)
        # log(1 - a), accurate at both ends (a near 0 and near 1).
        log_not_a = torch.where(
            log_a > -math.log(2), torch.log(-torch.expm1(log_a)), torch.log1p(-log_a.exp())
        )
        value = -(y * log_a + (1 - y) * log_not_a).mean()
        value.backward()
        return value

    opt.step(loss)
    t = min(max(math.exp(-log_scale.item()), _TEMPERATURE_RANGE[0]), _TEMPERATURE_RANGE[1])
    return t, min(max(offset.item(), _OFFSET_RANGE[0]), _OFFSET_RANGE[1])


@dataclass
class Calibration:
    """STS temperatures, with STS with offsets their offsets (stored in a drafter folder's
    calibration.json: dspark.artifacts); c_k = σ(z_k / T_k + b_k), b = 0 without offsets."""

    temperatures: list[float]
    offsets: list[float] | None = None

    def __post_init__(self) -> None:
        self.temperatures = [float(t) for t in self.temperatures]
        if not all(t > 0 and math.isfinite(t) for t in self.temperatures):
            raise ValueError("temperatures must be finite and positive")
        if self.offsets is not None:
            self.offsets = [float(b) for b in self.offsets]
            if len(self.offsets) != len(self.temperatures) or not all(map(math.isfinite, self.offsets)):
                raise ValueError(f"need {len(self.temperatures)} finite offsets, got {self.offsets}")

    @classmethod
    def of(cls, value) -> Calibration | None:
        """``value`` as a Calibration: itself; bare STS temperatures (a list, a tensor) as STS; None."""
        if value is None or isinstance(value, Calibration):
            return value
        return cls(torch.as_tensor(value, dtype=torch.float64).flatten().tolist())

    @property
    def biases(self) -> list[float]:
        """b_k per position: the offsets, or zeros for STS."""
        return self.offsets or [0.0] * len(self.temperatures)

    @property
    def method(self) -> str:
        return "sts" if self.offsets is None else "sts_offsets"

    @classmethod
    def fit(
        cls, logits: Tensor, labels: Tensor, valid: Tensor, offsets: bool = False, **kwargs
    ) -> Calibration:
        """STS (the paper's), or with ``offsets`` STS with offsets; ``kwargs`` go to the fit."""
        if offsets:
            temps, offs = fit_sts_offsets(logits, labels, valid, **kwargs)
            return cls(temps.tolist(), offs.tolist())
        return cls(fit_sts(logits, labels, valid, **kwargs).tolist())

    def cumulative(self, logits: Tensor) -> Tensor:
        """Calibrated prefix-survival probabilities a_k for ``logits [..., γ]``."""
        return cumulative_confidence(logits, self.temperatures, self.offsets)

    def to_dict(self) -> dict:
        out = {"method": self.method, "temperatures": list(self.temperatures)}
        return out if self.offsets is None else {**out, "offsets": list(self.offsets)}

    @classmethod
    def from_dict(cls, d: dict) -> Calibration:
        method = d.get("method", "sts")
        if method not in ("sts", "sts_offsets") or (method == "sts_offsets") != ("offsets" in d):
            raise ValueError(f"unsupported calibration method {method!r} with keys {sorted(d)}")
        return cls(list(d["temperatures"]), d.get("offsets"))

    def save(self, path: str | os.PathLike) -> Path:
        """Write the JSON file atomically (a reader never sees a half-written file)."""
        path = Path(path)
        # json writes floats with repr(), which round-trips float64 exactly.
        atomic_write_json(path, self.to_dict())
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> Calibration:
        """The temperatures in a calibration.json; DataError naming the file when it holds none."""
        data = read_json(path)
        try:
            return cls.from_dict(data)
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise DataError(
                f"{path} is not a calibration file ({type(err).__name__}: {err}): expected "
                f'{{"method": "sts", "temperatures": [positive numbers]}} (or "sts_offsets" with "offsets"); '
                f"delete it or refit it"
            ) from None
