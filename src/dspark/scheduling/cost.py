"""Step-time cost model for load-aware verification scheduling (paper §2.1, §3.2.2).

One decoding round costs ``T_draft(R, γ_d) + T_verify(B) + overhead``: the drafter runs once per
round for the ``R`` active requests and drafts ``γ_d`` positions, the target verifies
``B = R + sum(l_r)`` tokens (anchors + admitted drafts), and ``overhead`` is the host work of a
speculative round that the step timings do not see. A round that drafts nothing is plain decoding
and costs ``T_verify(R)`` alone. A policy whose verify width depends on the round's confidences
makes the engine read that width back between the draft and the target step: the device idles
while the host launches the rest of the round (``readback_ms``), which only a wide enough saving
in verification pays for. A padded engine verifies ``R`` rows ``w`` wide; with ``verify_width_ms``
measured per width, such a step is priced at its own row count (``verify_rows_ms``), not at the
token count ``R·w`` of the curve, whose points were measured with fewer, wider rows. The curves
are measured once on the engine and stored as small tables; the scheduler reads ``SPS(B) = 1 /
step_time`` from them by interpolation, an O(1) lookup per candidate on Algorithm 1's admission
path (on the device: ``verify_table``).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..core.errors import DataError

if TYPE_CHECKING:
    import torch

__all__ = ["CostModel", "CostTableError", "profile"]

_FORMAT = "dspark.cost_model/v1"


class CostTableError(DataError):
    """A measured or saved table that cannot be a step-time curve."""


def _positive_ints(name: str, keys: Iterable[Any], zero: bool = False) -> list[int]:
    """The table's keys (batch sizes, row counts, drafted lengths) as positive integers (or
    non-negative ones, with ``zero``: a plain round drafts 0 positions)."""
    out: list[int] = []
    for k in keys:
        # JSON turns int keys into strings, so accept "64" but never 64.5 or True.
        if isinstance(k, bool):
            raise CostTableError(f"{name}: key {k!r} is not an integer")
        try:
            ik = int(k)
        except (TypeError, ValueError):
            raise CostTableError(f"{name}: key {k!r} is not an integer") from None
        if float(k) != ik:
            raise CostTableError(f"{name}: key {k!r} is not an integer")
        if ik < (0 if zero else 1):
            raise CostTableError(f"{name}: key must be {'non-negative' if zero else 'positive'}, got {k!r}")
        out.append(ik)
    return out


def _as_table(name: str, table: Mapping[Any, Any], monotone_tol: float) -> tuple[np.ndarray, np.ndarray]:
    if not table:
        raise CostTableError(f"{name}: empty table; profile at least one batch size")
    keys = _positive_ints(name, table)
    if len(set(keys)) != len(keys):
        raise CostTableError(f"{name}: duplicate batch sizes {sorted(keys)}")
    pairs = sorted((ik, float(v)) for ik, v in zip(keys, table.values()))
    bad = [(b, t) for b, t in pairs if not (math.isfinite(t) and t > 0)]
    if bad:
        raise CostTableError(f"{name}: step times must be finite and > 0 ms; offending (B, ms): {bad}")
    # Real curves are jagged (wave quantisation, kernel switches), so small dips are noise; a
    # large dip means a broken measurement (e.g. a missing sync) and would make larger batches
    # look free. Compare against the running maximum so a slow staircase of dips is caught too.
    offenders = []
    peak_b, peak_t = pairs[0]
    for b, t in pairs[1:]:
        if t < (1.0 - monotone_tol) * peak_t:
            offenders.append(f"B={peak_b}: {peak_t:.4g} ms -> B={b}: {t:.4g} ms")
        if t > peak_t:
            peak_b, peak_t = b, t
    if offenders:
        raise CostTableError(
            f"{name}: step time decreases with batch size by more than {monotone_tol:.0%}: "
            + "; ".join(offenders)
        )
    xs = np.array([b for b, _ in pairs], dtype=np.float64)
    ys = np.array([t for _, t in pairs], dtype=np.float64)
    return xs, ys


def _curves(name: str, tables: Mapping[Any, Mapping[Any, float]] | None, monotone_tol: float, key: str,
            zero: bool = False) -> dict[int, tuple[np.ndarray, np.ndarray]] | None:  # fmt: skip
    """``{key: {R: ms}}`` (per drafted length, per width) as one checked curve per key, or None."""
    if tables is None:
        return None
    if not tables:
        raise CostTableError(f"{name}: empty table; profile at least one {key}")
    keys = _positive_ints(name, tables, zero=zero)
    return {k: _as_table(f"{name}[{k}]", t, monotone_tol) for k, t in sorted(zip(keys, tables.values()))}


def _to_device(values: np.ndarray, device) -> torch.Tensor:
    """A float64 host table on ``device``; pinned first on CUDA, so the copy does not wait for it."""
    import torch

    host = torch.from_numpy(np.asarray(values, dtype=np.float64))
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def _interp(xs: np.ndarray, ys: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Piecewise-linear through the points; below the first point: its value (a step cannot get
    cheaper than the smallest measured one); beyond the last: the slope of the last two points,
    floored at 0 so a within-tolerance dip at the end never extrapolates to negative times."""
    out = np.interp(q, xs, ys)
    if len(xs) >= 2:
        slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)
        hi = q > xs[-1]
        out = np.where(hi, ys[-1] + slope * (q - xs[-1]), out)
    return out


class CostModel:
    """Measured round time: ``T_draft(R, γ_d) + T_verify(B) + overhead``.

    Args:
        verify_ms: target verification step time (ms) by token batch size ``B``.
        draft_ms: drafter step time (ms) by concurrency ``R``, the whole block drafted; ``None`` =
            drafting is free (or folded into ``verify_ms``).
        context_len: context length the table was profiled at (attention cost grows with it).
        meta: free-form provenance (device, dtype, commit, ...); must be JSON-serialisable.
        monotone_tol: relative dip in step time with growing ``B`` tolerated as noise.
        draft_len_ms: the draft step by drafted length, ``{γ_d: {R: ms}}`` (a drafter that drafts
            fewer positions skips their LM head and sampling); lengths between the profiled ones
            are interpolated, a length beyond them costs the longest one's time.
        overhead_ms: host time of a drafting round that the step timings miss (its policy and
            bookkeeping when they are not hidden behind the device's work), per round.
        padded: the engine verifies rows padded to the widest (ours do), so a step over R rows of
            at most ℓ drafts costs ``T_verify(R · (1 + ℓ))``, not ``T_verify(R + Σℓ)`` (a ragged
            kernel's); Algorithm 1 then walks whole depths (every row one position deeper).
        readback_ms: what a round loses when the engine reads its verify width back from the
            device (the bubble between the draft step and the target step), per round.
        round_len_ms: whole rounds as the engine runs them, ``{γ_d: {R: ms}}`` (``γ_d = 0``: a
            plain round), every row verifying its whole draft: where a drafted length has one,
            ``round_time`` of such a round reads it instead of adding up the separately timed
            steps and the overhead (which miss the steps' overlap and the work between them).
        verify_width_ms: the verify step by width, ``{w: {R: ms}}`` (R rows, each ``w`` tokens
            wide): what a padded step of R rows at a width costs. ``verify_ms`` mixes shapes
            (below γ + 1 tokens single-token rows, above it rows γ + 1 wide), so reading it at
            ``R·w`` prices a narrower step of the same R rows as one of fewer rows: cheaper
            attention and per-row work than the engine runs. Widths between the measured ones
            are interpolated, wider ones extrapolated from the last two.
    """

    def __init__(
        self,
        verify_ms: Mapping[int, float],
        draft_ms: Mapping[int, float] | None = None,
        context_len: int | None = None,
        meta: dict | None = None,
        monotone_tol: float = 0.05,
        draft_len_ms: Mapping[int, Mapping[int, float]] | None = None,
        overhead_ms: float = 0.0,
        padded: bool = False,
        readback_ms: float = 0.0,
        round_len_ms: Mapping[int, Mapping[int, float]] | None = None,
        verify_width_ms: Mapping[int, Mapping[int, float]] | None = None,
    ) -> None:
        if not 0.0 <= monotone_tol < 1.0:
            raise CostTableError(f"monotone_tol must be in [0, 1), got {monotone_tol}")
        if context_len is not None and int(context_len) <= 0:
            raise CostTableError(f"context_len must be positive, got {context_len}")
        for name, value in (("overhead_ms", overhead_ms), ("readback_ms", readback_ms)):
            if not (math.isfinite(float(value)) and float(value) >= 0):
                raise CostTableError(f"{name} must be finite and >= 0, got {value}")
        self.monotone_tol = float(monotone_tol)
        self._vx, self._vy = _as_table("verify_ms", verify_ms, monotone_tol)
        self._d = None if draft_ms is None else _as_table("draft_ms", draft_ms, monotone_tol)
        self._dl = _curves("draft_len_ms", draft_len_ms, monotone_tol, "drafted length")
        # round_len_ms has a length 0: a plain round
        self._rl = _curves("round_len_ms", round_len_ms, monotone_tol, "drafted length", zero=True)
        self._vw = _curves("verify_width_ms", verify_width_ms, monotone_tol, "width")
        self.overhead_ms = float(overhead_ms)
        self.readback_ms = float(readback_ms)
        self.padded = bool(padded)
        self.context_len = None if context_len is None else int(context_len)
        self.meta = dict(meta or {})
        self._tables: dict = {}  # device copies of the verify curve (``verify_table``, ``depth_table``)
        self._rounds: dict = {}  # round_times, and as floats, per (R, γ, overhead): asked every round
        self._widths_at: dict = {}  # verify_width_ms read at R, per R
        self._widths_ms: dict = {}  # verify_rows_ms of one width, per (R, width)
        self._buckets: np.ndarray | None = None  # the rows an engine pads a round to (at_engine_rows)

    # ---- tables -------------------------------------------------------------------------
    def draft_vocab_mismatch(self, served: dict | None) -> str | None:
        """A warning where this table's draft steps were timed over another draft vocabulary
        (``meta["draft_vocab"]``, None: the whole) than the one a run serves (``served``, as
        ``data.vocab_counts.vocab_record`` writes it): they would misprice every round's draft
        step. None where they agree or the table times no draft step."""
        timed = self.meta.get("draft_vocab")
        if (self._d is None and self._dl is None) or timed == served:
            return None
        return (
            f"the cost table's draft steps were timed with draft vocabulary {timed} and price runs with "
            f"{served}: time them with the run's (engine_sps --draft-vocab, schedule measured.draft_vocab)"
        )

    @property
    def verify_ms(self) -> dict[int, float]:
        return {int(b): float(t) for b, t in zip(self._vx, self._vy)}

    @property
    def draft_ms(self) -> dict[int, float] | None:
        if self._d is None:
            return None
        return {int(r): float(t) for r, t in zip(*self._d)}

    @property
    def draft_len_ms(self) -> dict[int, dict[int, float]] | None:
        if self._dl is None:
            return None
        return {m: {int(r): float(t) for r, t in zip(*xy)} for m, xy in self._dl.items()}

    @property
    def round_len_ms(self) -> dict[int, dict[int, float]] | None:
        if self._rl is None:
            return None
        return {m: {int(r): float(t) for r, t in zip(*xy)} for m, xy in self._rl.items()}

    @property
    def verify_width_ms(self) -> dict[int, dict[int, float]] | None:
        if self._vw is None:
            return None
        return {w: {int(r): float(t) for r, t in zip(*xy)} for w, xy in self._vw.items()}

    def at_engine_rows(self, buckets: Iterable[int]) -> CostModel:
        """This table pricing a round of R live rows as an engine that pads them to ``buckets``
        runs it (the fast engine replays graphs captured per rows bucket): at the smallest bucket
        >= R, at R itself past the largest. Read at the live rows, a round of 150 rows in the
        256-row graph would be priced between the 64- and 256-row points, well below what it costs.
        The buckets belong to the engine, not the table: ``to_dict`` leaves them out."""
        rows = sorted({int(b) for b in buckets})
        if not rows or rows[0] < 1:
            raise ValueError(f"engine row buckets must be positive row counts, got {rows}")
        priced = CostModel.from_dict(self.to_dict())
        priced._buckets = np.array(rows, dtype=np.float64)
        return priced

    def _engine_rows(self, R):
        """The rows a round of ``R`` live rows runs (``at_engine_rows``); ``R`` without buckets."""
        if self._buckets is None:
            return R
        r = np.asarray(R, dtype=np.float64)
        at = self._buckets[np.minimum(np.searchsorted(self._buckets, r), self._buckets.size - 1)]
        out = np.where(r <= self._buckets[-1], at, r)
        return float(out) if np.ndim(R) == 0 else out

    # ---- lookups ------------------------------------------------------------------------
    def step_time(self, B, R=None):
        """Round time in seconds for ``B`` verified tokens and ``R`` drafting requests.

        Scalars in, float out; array-likes broadcast to an ndarray. ``R`` is ignored when there
        is no draft table and required when there is one.
        """
        scalar = np.ndim(B) == 0 and np.ndim(R) == 0
        b = np.asarray(B, dtype=np.float64)
        if np.any(b <= 0):
            raise ValueError(f"batch size must be positive, got {B!r}")
        ms = _interp(self._vx, self._vy, b)
        drafts = self._d is not None or self._dl is not None
        if drafts and R is None:
            raise ValueError("this cost model has a draft table; pass R (active requests)")
        if drafts or self.overhead_ms:
            ms = ms + self.fixed_ms(R)
        s = ms * 1e-3
        return float(s) if scalar else s

    def sps(self, B, R=None):
        """Rounds (target steps) per second: ``1 / step_time(B, R)``."""
        t = self.step_time(B, R)
        return 1.0 / t

    def verify_time_ms(self, B) -> float:
        """``T_verify(B)`` in ms (no draft step, no overhead)."""
        return float(_interp(self._vx, self._vy, np.float64(B)))

    def verify_rows_ms(self, R: int, widths) -> np.ndarray | float:
        """``T_verify`` in ms of ``R`` rows each ``widths`` tokens wide (a scalar or an array of
        widths >= 1): the padded step the engine runs. From ``verify_width_ms`` when measured (each
        measured width's curve read at R, linear in the width between them, the last two widths'
        slope beyond, floored at 0 like ``_interp``), else the token curve at ``R·w``."""
        try:  # a policy asks the same few every round: a scalar width asked before is kept
            return self._widths_ms[R, widths]
        except (KeyError, TypeError):  # TypeError: an array of widths (unhashable)
            pass
        # isinstance first: np.ndim costs a few µs
        scalar = isinstance(widths, (int, float, np.number)) or np.ndim(widths) == 0
        w = np.asarray(widths, dtype=np.float64)
        rows = R
        R = self._engine_rows(R)
        if self._vw is None:
            out = _interp(self._vx, self._vy, R * w)
        else:
            at = self._widths_at.get(R)
            if at is None:  # the measured widths and their times at R, kept: asked every round
                xs = np.array(sorted(self._vw), dtype=np.float64)
                ys = np.array([_interp(*self._vw[int(x)], np.float64(R)) for x in xs])
                at = self._widths_at[R] = (xs, ys)
            out = _interp(*at, w)
        if scalar:
            out = self._widths_ms[rows, widths] = float(out)
        return out

    def depth_table(self, R: int, depth: int, device) -> torch.Tensor:
        """``verify_rows_ms(R, 1 + d)`` for ``d = 0..depth`` as a float64 tensor on ``device``: a
        padded walk's price of each depth, built once per ``(R, depth, device)``."""
        key = (str(device), int(R), int(depth))
        table = self._tables.get(key)
        if table is None:
            table = self._tables[key] = _to_device(self.verify_rows_ms(R, 1 + np.arange(depth + 1)), device)
        return table

    def fixed_ms(self, R, drafted: int | None = None):
        """What a drafting round costs whatever it verifies: the draft step at ``R`` (of
        ``drafted`` positions when the table has per-length curves, else the whole block; when
        profiled) plus the overhead, in ms."""
        draft = 0.0 if self._d is None and self._dl is None else self._draft_ms(R, drafted)
        return draft + self.overhead_ms

    def _draft_ms(self, R, drafted: int | None = None):
        r = np.asarray(R, dtype=np.float64)
        if np.any(r <= 0):
            raise ValueError(f"concurrency R must be positive, got {R!r}")
        r = np.asarray(self._engine_rows(r))
        if drafted is None and self._d is not None or self._dl is None:
            return 0.0 if self._d is None else _interp(*self._d, r)
        if drafted is None:  # the whole block: the longest profiled length
            drafted = max(self._dl)
        lengths = sorted(self._dl)
        lo = max([m for m in lengths if m <= drafted], default=lengths[0])
        hi = min([m for m in lengths if m >= drafted], default=lengths[-1])
        t_lo, t_hi = _interp(*self._dl[lo], r), _interp(*self._dl[hi], r)
        if hi == lo:  # profiled, or outside the table: the nearest length's time
            return t_lo
        return t_lo + (t_hi - t_lo) * (drafted - lo) / (hi - lo)

    def round_time(self, R: int, drafted: int, B: int | None = None) -> float:
        """Seconds of one round of ``R`` requests that drafts ``drafted`` positions (0: plain
        decoding, no draft step and no overhead) and verifies ``B`` tokens (default ``R·(drafted
        + 1)``: every row verifies its whole draft, as the engines' padded steps cost; the measured
        round of that length when ``round_len_ms`` has it)."""
        if R <= 0 or drafted < 0:
            raise ValueError(f"need R > 0 and drafted >= 0, got R={R}, drafted={drafted}")
        if B is None and self._rl is not None and drafted in self._rl:
            return float(_interp(*self._rl[drafted], np.float64(self._engine_rows(R)))) * 1e-3
        if B is None:  # every row verifies its whole draft: R rows, drafted + 1 wide
            ms = float(self.verify_rows_ms(R, drafted + 1))
        else:
            ms = float(_interp(self._vx, self._vy, np.float64(B)))
        if drafted:
            ms += float(self._draft_ms(R, drafted)) + self.overhead_ms
        return ms * 1e-3

    def round_times(self, R: int, gamma: int) -> np.ndarray:
        """``round_time(R, m)`` for ``m = 0..gamma`` (seconds), kept per ``(R, gamma)``: the
        pre-draft choice reads it every round."""
        return self._round_times(R, gamma)[0]

    def round_seconds(self, R: int, gamma: int) -> tuple[float, ...]:
        """``round_times`` as a tuple of floats, kept alike: the policies' arithmetic on the host
        loops over its few entries, which costs less than a numpy call on them."""
        return self._round_times(R, gamma)[1]

    def _round_times(self, R: int, gamma: int) -> tuple[np.ndarray, tuple[float, ...]]:
        key = (int(R), int(gamma), self.overhead_ms)
        times = self._rounds.get(key)
        if times is None:
            array = np.array([self.round_time(R, m) for m in range(gamma + 1)])
            times = self._rounds[key] = (array, tuple(array.tolist()))
        return times

    def verify_table(self, max_B: int, device) -> torch.Tensor:
        """``T_verify(B)`` in ms for ``B = 0..max_B`` as a float64 tensor on ``device`` (entry 0
        repeats entry 1), so a policy prices its admission path without leaving the device. Built
        once per device and grown when a larger batch is asked for."""
        key = str(device)
        table = self._tables.get(key)
        if table is None or table.numel() <= max_B:
            size = max(int(max_B) + 1, 2 * (table.numel() if table is not None else 0), 64)
            b = np.maximum(np.arange(size, dtype=np.float64), 1.0)
            table = self._tables[key] = _to_device(_interp(self._vx, self._vy, b), device)
        return table

    # ---- synthetic tables -----------------------------------------------------------------
    @classmethod
    def analytical(
        cls,
        base_ms: float = 10.0,
        knee: int = 64,
        ms_per_token: float | None = None,
        max_batch: int = 4096,
        tile: int | None = None,
        draft_ms: Mapping[int, float] | float | None = None,
        **kw,
    ) -> CostModel:
        """Roofline-shaped table: flat at ``base_ms`` up to ``knee`` tokens (memory-bound), then
        linear at ``ms_per_token`` (compute-bound; default continues the roofline, i.e.
        ``base_ms / knee``). With ``tile``, the compute-bound part is charged per started tile of
        ``tile`` tokens, giving the jagged staircase of §5.2. ``draft_ms`` as a float is a
        constant drafter cost."""
        if knee < 1 or max_batch < knee:
            raise CostTableError(f"need 1 <= knee <= max_batch, got knee={knee}, max_batch={max_batch}")
        slope = base_ms / knee if ms_per_token is None else float(ms_per_token)

        def f(b: int) -> float:
            if tile is not None:
                b = -(-b // tile) * tile  # round up to a whole tile
            return base_ms + slope * max(0, b - knee)

        # A roofline is exact with its corners; a staircase needs every B, or interpolation
        # would smooth the cliffs away.
        points = sorted({1, knee, max(knee + 1, max_batch)}) if tile is None else range(1, max_batch + 1)
        verify = {b: f(b) for b in points}
        if isinstance(draft_ms, (int, float)):
            draft_ms = {1: float(draft_ms)}
        meta = {"analytical": {"base_ms": base_ms, "knee": knee, "ms_per_token": slope, "tile": tile}}
        meta.update(kw.pop("meta", None) or {})
        return cls(verify, draft_ms=draft_ms, meta=meta, **kw)

    # ---- serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "format": _FORMAT,
            "verify_ms": {str(b): t for b, t in self.verify_ms.items()},
            "draft_ms": None if self._d is None else {str(r): t for r, t in self.draft_ms.items()},
            "draft_len_ms": None
            if self._dl is None
            else {str(m): {str(r): t for r, t in tab.items()} for m, tab in self.draft_len_ms.items()},
            "overhead_ms": self.overhead_ms,
            "readback_ms": self.readback_ms,
            "round_len_ms": None
            if self._rl is None
            else {str(m): {str(r): t for r, t in tab.items()} for m, tab in self.round_len_ms.items()},
            "verify_width_ms": None
            if self._vw is None
            else {str(w): {str(r): t for r, t in tab.items()} for w, tab in self.verify_width_ms.items()},
            "padded": self.padded,
            "context_len": self.context_len,
            "monotone_tol": self.monotone_tol,
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> CostModel:
        fmt = d.get("format")
        if fmt != _FORMAT:
            raise CostTableError(f"unknown cost-model format {fmt!r}; expected {_FORMAT!r}")
        if "verify_ms" not in d:
            raise CostTableError("cost-model JSON lacks 'verify_ms'")
        return cls(
            d["verify_ms"],
            draft_ms=d.get("draft_ms"),
            context_len=d.get("context_len"),
            meta=d.get("meta"),
            monotone_tol=d.get("monotone_tol", 0.05),
            draft_len_ms=d.get("draft_len_ms"),
            overhead_ms=d.get("overhead_ms") or 0.0,
            padded=bool(d.get("padded", False)),
            readback_ms=d.get("readback_ms") or 0.0,
            round_len_ms=d.get("round_len_ms"),
            verify_width_ms=d.get("verify_width_ms"),
        )

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)

    @classmethod
    def from_json(cls, s: str) -> CostModel:
        return cls.from_dict(json.loads(s))

    def save(self, path: str | os.PathLike) -> Path:
        """Atomic write: a reader sees the old table or the new one, never half a file."""
        from ..core.io import atomic_open

        path = Path(path)
        with atomic_open(path) as f:
            f.write(self.to_json())
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> CostModel:
        """A table saved by ``save``; CostTableError when the file holds none."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
            if not isinstance(data, Mapping):
                raise TypeError("not a JSON object")
            return cls.from_dict(data)
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
            raise CostTableError(f"not a cost table ({type(err).__name__}: {err})") from None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CostModel) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        b = self._vx
        return (
            f"CostModel({len(b)} points, B={int(b[0])}..{int(b[-1])}, "
            f"draft={'yes' if self._d is not None else 'no'}, "
            f"draft lengths={sorted(self._dl) if self._dl else 'no'}, overhead={self.overhead_ms} ms, "
            f"read-back={self.readback_ms} ms, "
            f"measured rounds={sorted(self._rl) if self._rl else 'no'}, "
            f"verify widths={sorted(self._vw) if self._vw else 'no'}, "
            f"{'padded' if self.padded else 'ragged'}, "
            f"context_len={self.context_len})"
        )


def _auto_sync() -> None:
    # Only synchronise a CUDA context that already exists: initialising one just to time a CPU
    # step would cost seconds and GPU memory.
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def profile(
    step_fn: Callable[[int], None],
    batch_sizes: Iterable[int],
    warmup: int = 2,
    repeats: int = 5,
    timer: Callable[[], float] = time.perf_counter,
    sync: Callable[[], None] | None = _auto_sync,
) -> dict[int, float]:
    """Median wall time (ms) of ``step_fn(B)`` for each ``B``.

    Warm-up runs per ``B`` absorb one-off costs (CUDA-graph capture per bucket, allocator
    growth, autotuning). ``sync`` runs before starting and before stopping the clock so
    asynchronous device work is inside the measurement; pass ``None`` for pure-CPU steps.
    The median resists the occasional preemption on shared machines.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    do_sync = sync if sync is not None else (lambda: None)
    out: dict[int, float] = {}
    for b in batch_sizes:
        b = int(b)
        if b <= 0:
            raise ValueError(f"batch size must be positive, got {b}")
        for _ in range(warmup):
            step_fn(b)
        do_sync()
        samples = []
        for _ in range(repeats):
            do_sync()
            t0 = timer()
            step_fn(b)
            do_sync()
            samples.append((timer() - t0) * 1e3)
        out[b] = float(statistics.median(samples))
    return out
