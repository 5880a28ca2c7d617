"""Sequential Temperature Scaling (STS, DSpark §3.2.1).

Each confidence c_k = σ(z_k) is conditional on the earlier draft tokens surviving, so the probability
that a length-k prefix is accepted is a_k = Π_{i≤k} σ(z_i / T_i). STS fits T_1, T_2, ... left to
right on held-out data: T_k is the grid point minimising the ECE of a_k with T_{<k} already fixed.
Positive temperatures keep each position's ranking of c_k intact.
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
from .metrics import _check_inputs, _ece_l1

__all__ = [
    "Calibration",
    "cumulative_confidence",
    "default_grid",
    "fit_sts",
]

# Bounds the [grid_chunk, M] candidate matrix built per position (16-32 MB).
_MAX_CHUNK_ELEMS = 1 << 22


def default_grid() -> Tensor:
    """200 log-spaced temperatures over [0.05, 20] plus T = 1 (identity), sorted, float64."""
    g = torch.logspace(math.log10(0.05), math.log10(20.0), 200, dtype=torch.float64)
    return torch.unique(torch.cat([g, torch.ones(1, dtype=torch.float64)]))


def cumulative_confidence(logits: Tensor, temperatures: Tensor | Sequence[float] | None = None) -> Tensor:
    """a_k = Π_{i≤k} σ(z_i / T_i) over the last dim, summed in log space so long products of small
    confidences don't underflow before the final exp. Returns float32 or wider."""
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
    T_k depends on T_{<k}.
    """
    _check_inputs(logits, labels, valid)
    n, gamma = logits.shape
    grid = default_grid() if grid is None else torch.as_tensor(grid, dtype=torch.float64).flatten()
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
    log_prefix = torch.zeros(n, dtype=dt)  # Σ_{i<k} logσ(z_i/T_i) with the fitted T_i
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


@dataclass
class Calibration:
    """STS temperatures (stored in a drafter folder's calibration.json: dspark.artifacts)."""

    temperatures: list[float]

    def __post_init__(self) -> None:
        self.temperatures = [float(t) for t in self.temperatures]
        if not all(t > 0 and math.isfinite(t) for t in self.temperatures):
            raise ValueError("temperatures must be finite and positive")

    @classmethod
    def fit(cls, logits: Tensor, labels: Tensor, valid: Tensor, **kwargs) -> Calibration:
        return cls(fit_sts(logits, labels, valid, **kwargs).tolist())

    def cumulative(self, logits: Tensor) -> Tensor:
        """Calibrated prefix-survival probabilities a_k for ``logits [..., γ]``."""
        return cumulative_confidence(logits, self.temperatures)

    def to_dict(self) -> dict:
        return {"method": "sts", "temperatures": list(self.temperatures)}

    @classmethod
    def from_dict(cls, d: dict) -> Calibration:
        if d.get("method", "sts") != "sts":
            raise ValueError(f"unsupported calibration method {d.get('method')!r}")
        return cls(list(d["temperatures"]))

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
                f'{{"method": "sts", "temperatures": [positive numbers]}}; delete it or refit it'
            ) from None
