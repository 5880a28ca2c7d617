"""Verification-length policies: how many draft tokens ``l_r`` of each request the target verifies.

Every policy maps calibrated per-position confidences ``c[r, i]`` (probability that draft token
``i`` survives given that all before it did, §3.2.1) to lengths ``l [R]``. Lossless verification
needs the *non-anticipating* property (Appendix A): whether ``l_r >= k`` may depend on anything
known before ``x_{r,k}`` is sampled, but not on ``x_{r,k}`` itself. Since ``c[r, k+1]`` is computed
from ``x_{r,k}`` (Markov feature), a policy must not let ``a[r, j > k]`` influence ``l_r >= k``.

- ``Fixed``, ``Mtp1``: per-request, trivially non-anticipating.
- ``Threshold``: per-request; it drafts one position more than the longest prefix it verified in
  its last completed rounds (a bound from the past, so the verify width is known before drafting
  and the engine never reads it back).
- ``HardwareAware``: Algorithm 1. Before drafting it chooses how many positions to draft (none at
  a load where speculation cannot pay) from the acceptance of completed rounds, as ``DraftAware``
  does; then, when the saving pays for reading the width back, it walks the admission path on the
  round's confidences. The walk visits ``(r, k)`` before any ``(r, j > k)`` and stops on ``(r, k)``
  from the path so far only, so ``a[r, j > k]`` never matters. On a padded engine (every row
  verified as wide as the widest) one step of the path is one whole depth: all rows' position
  ``k`` together, priced as ``R`` rows ``1 + k`` wide (``CostModel.verify_rows_ms``).
- ``AsyncTopK`` (§5.2): the budget ``K`` is fixed from stale confidences; the current top-K by
  rank admits ``(r, k)`` iff fewer than ``K`` candidates outrank it, and ``(r, j > k)`` never do.
- ``DraftAware``: decides *before drafting* how many positions to draft this round, none at all
  (plain decoding) when speculation cannot pay at this load, from the outcomes of rounds already
  completed and the cost of drafting; it then verifies every drafted position. A choice made
  before the draft exists cannot depend on it: lossless.
- ``Retrospective``: the unconstrained argmax over the whole path on *current* confidences. It
  looks past ``(r, k)`` and is NOT lossless; it exists only as the negative control for tests
  and as a throughput upper bound in diagnostics.

One round asks a policy three things, in this order:
  1. ``draft_length(R, γ, cost)`` before drafting: how many positions to draft (0..γ; default γ);
  2. ``lengths(confidences [R, γ_d], cost)`` after drafting: ``l [R]``, computed where the
     confidences live (no host synchronisation: the engines keep it on the device);
     ``width(γ_d)`` says the verify width (a bound on ``l``) in advance when it does not depend
     on the confidences, so the engine need not read it back;
  3. ``observe_round(lengths, accepted)`` once the round's outcome reaches the host (the engines
     report a round while the next one runs, so round ``t`` is planned from rounds ``<= t - 2``).
A policy says what it needs (``needs_confidence``, ``needs_cost``) and whether it is ``lossless``;
callers ask it, never its name. ``build_policy`` is the one way to make one from configuration.
"""

from __future__ import annotations

import inspect
import math
import operator
import re
from collections import deque
from collections.abc import Mapping
from itertools import accumulate
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor

from ..core.errors import ConfigError
from ..core.tensors import kept_tensor
from .cost import CostModel

__all__ = [
    "POLICIES",
    "AcceptanceEstimate",
    "AsyncTopK",
    "DraftAware",
    "Fixed",
    "HardwareAware",
    "Mtp1",
    "Policy",
    "Retrospective",
    "RoundClock",
    "Threshold",
    "Truncated",
    "admission_order",
    "build_policy",
    "depth_path",
    "expected_rates",
    "expected_tokens",
    "prefix_survival",
    "throughput_path",
]

# What decided a planned round (``Policy.plan_record``): per drafted length 0..γ its expected rate, the
# rounds' clock's measured / priced ratio it was priced at, and the tokens it was expected to emit.
PlanRecord = tuple[list[float], list[float], list[float]]


# ---------------------------------------------------------------------------------------------
# shared pieces
# ---------------------------------------------------------------------------------------------
def prefix_survival(confidences: Tensor) -> Tensor:
    """``a[r, j] = prod_{i <= j} c[r, i]`` in float64 (the Θ comparisons are exact-tie sensitive).

    Validates shape, and the range of host tensors (a device tensor comes from the engine, and
    checking it would stall the round on a read-back); for c in [0, 1] a float product never
    grows, so ``a`` is non-increasing along each row, which every policy below relies on.
    """
    if confidences.dim() != 2:
        raise ValueError(f"confidences must be [R, gamma], got shape {tuple(confidences.shape)}")
    c = confidences.detach().to(torch.float64)
    if c.device.type == "cpu" and c.numel() and bool(((c < 0) | (c > 1) | torch.isnan(c)).any()):
        raise ValueError("confidences must be calibrated probabilities in [0, 1] (no NaN)")
    return torch.cumprod(c, dim=1)


def admission_order(confidences: Tensor, keep_dead: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Candidates ``(r, j)`` with ``a[r, j] > 0`` sorted by ``a`` descending, ties to smaller ``j``
    then smaller ``r``. Returns ``(rows, j, a_sorted)``; ``j`` is 1-based (the length that
    admitting the candidate sets ``l_r`` to). ``keep_dead`` keeps the dead candidates (``a = 0``,
    sorted last) instead of dropping them, which needs no read-back: the policies then mask them."""
    a = prefix_survival(confidences)
    R, G = a.shape
    # Flatten position-major (index = j * R + r) so a stable sort breaks ties by j, then r.
    flat = a.t().reshape(-1)
    a_sorted, order = torch.sort(flat, descending=True, stable=True)
    if not keep_dead:
        # Algorithm 1 line 4: a dead prefix is never a candidate. Zeros sort last, so slicing
        # drops them (boolean-mask indexing is ~1000x slower than a slice on CPU here).
        alive = int((a_sorted > 0).sum())
        order, a_sorted = order[:alive], a_sorted[:alive]
    return order % R, order // R + 1, a_sorted


def throughput_path(
    a_sorted: Tensor, R: int, cost: CostModel, j: Tensor | None = None, drafted: int | None = None
) -> Tensor:
    """Θ along the greedy path: entry ``n`` is the expected token throughput with the first ``n``
    sorted candidates admitted, ``(R + sum a) * SPS(B_n)``; entry 0 is ``R * SPS(R)``. ``B_n = R +
    n``, or with a ``padded`` cost model (an engine that pads rows to the widest) and the
    candidates' positions ``j``, ``R · (1 + the deepest admitted j)``. Every entry also pays the
    round's fixed part (the draft step of ``drafted`` positions, default the whole block, and the
    overhead): sunk once the draft exists, but part of the time the tokens are divided by. Priced
    on ``a_sorted``'s device (``CostModel.verify_table``), the same arithmetic as ``cost.sps``."""
    n = a_sorted.numel()
    if cost.padded and j is not None and n:
        width = torch.cat([j.new_zeros(1), torch.cummax(j, 0).values])  # j <= n: a bound without a read-back
        # R rows at every depth: the depth's own price (``depth_table``) where j's bound is known
        ms = (
            cost.depth_table(R, drafted, a_sorted.device)[width]
            if drafted is not None
            else cost.verify_table(R * (1 + n), a_sorted.device)[R * (1 + width)]
        )
    else:
        ms = cost.verify_table(R + n, a_sorted.device)[R : R + n + 1]
    ms = ms + float(cost.fixed_ms(R, drafted))
    sps = 1.0 / (ms * 1e-3)
    tau = R + torch.cat([a_sorted.new_zeros(1), torch.cumsum(a_sorted, 0)])
    return tau * sps


def _lengths_from_prefix(rows: Tensor, j: Tensor, n, R: int, check: bool = True, alive=None) -> Tensor:
    """Lengths after admitting the first ``n`` sorted candidates (``n`` may be a 0-d tensor);
    ``alive`` masks out dead candidates kept in the order."""
    admitted = torch.arange(rows.numel(), device=rows.device) < n
    if alive is not None:
        admitted &= alive
    lengths = torch.zeros(R, dtype=torch.long, device=rows.device)
    lengths.scatter_add_(0, rows, admitted.long())
    if check:
        # Admission in sorted order must extend contiguous prefixes: per row, the count of
        # admitted candidates equals the deepest admitted position.
        deepest = torch.zeros_like(lengths).scatter_reduce_(0, rows, j * admitted, reduce="amax")
        if not torch.equal(deepest, lengths):
            raise AssertionError("admission order broke the contiguous-prefix invariant")
    return lengths


def _whole_draft(cache: dict, confidences: Tensor) -> Tensor:
    """Every row's whole draft, ``[γ_d] * R`` (long) on the confidences' device (``_filled``)."""
    if confidences.dim() != 2:
        raise ValueError(f"confidences must be [R, gamma], got shape {tuple(confidences.shape)}")
    R, G = confidences.shape
    return _filled(cache, R, G, confidences.device)


def _filled(cache: dict, rows: int, value: int, device: torch.device) -> Tensor:
    """``[value] * rows`` (long) on ``device``, made once per shape and device (``kept_tensor``)."""
    return kept_tensor(
        cache, (rows, value, device), lambda: torch.full((rows,), value, dtype=torch.long, device=device)
    )


def _empty(confidences: Tensor) -> Tensor | None:
    if confidences.dim() != 2:
        raise ValueError(f"confidences must be [R, gamma], got shape {tuple(confidences.shape)}")
    R, G = confidences.shape
    if R == 0 or G == 0:
        return torch.zeros(R, dtype=torch.long, device=confidences.device)
    return None


def _need_cost(policy: Policy, cost: CostModel | None) -> CostModel:
    if cost is None:
        raise ValueError(f"policy {policy.name!r} needs a CostModel (profiled SPS table)")
    return cost


def _search_budget(confidences: Tensor, cost: CostModel) -> Tensor:
    """Unconstrained search: the number of sorted candidates maximising Θ (first max on ties),
    a 0-d tensor on the confidences' device."""
    if _empty(confidences) is not None:
        return torch.zeros((), dtype=torch.long, device=confidences.device)
    _, j, a_sorted = admission_order(confidences, keep_dead=True)
    return torch.argmax(_live_path(a_sorted, j, confidences.shape[0], cost, confidences.shape[1]))


def _live_path(a_sorted: Tensor, j: Tensor, R: int, cost: CostModel, drafted: int | None = None) -> Tensor:
    """``throughput_path`` over an order that keeps dead candidates: admitting one is never an
    improvement (Alg. 1 line 4 drops them), so their Θ is -inf."""
    theta = throughput_path(a_sorted, R, cost, j, drafted)
    return torch.cat([theta[:1], torch.where(a_sorted > 0, theta[1:], -torch.inf)])


def depth_path(confidences: Tensor, cost: CostModel, extra_ms: float = 0.0) -> Tensor:
    """Θ per verify width ``w = 0..γ_d`` on a padded engine, every row verifying ``w`` drafts:
    ``(R + Σ_r Σ_{j<=w} a[r, j]) / (T_verify(R rows, 1 + w wide) + fixed)``, ``fixed`` being the
    draft step of the γ_d drafted positions, the overhead and ``extra_ms``. On the confidences'
    device."""
    a = prefix_survival(confidences)
    R, G = a.shape
    tau = R + torch.cat([a.new_zeros(1), torch.cumsum(a.sum(0), 0)])
    ms = cost.depth_table(R, G, a.device) + float(cost.fixed_ms(R, G)) + extra_ms
    return tau / ms


def _leading_run(theta: Tensor) -> Tensor:
    """Steps taken by a walk that stops at the first entry not beating the one before (0-d)."""
    return torch.cumprod((theta[1:] > theta[:-1]).long(), 0).sum()


class AcceptanceEstimate:
    """``ĉ_j``: the rate at which draft position ``j`` was accepted when reached, over completed
    rounds, each position remembering about its last ``memory`` tries (every try it is reached
    keeps ``1 - 1/memory`` of the older weight), with one optimistic pseudo-acceptance, so a position
    never measured looks worth drafting and gets measured. Memory counted in tries, not rounds: at
    R = 1 a deep position is reached in a few rounds of a hundred, and a per-round decay left it
    ~1 try of evidence (the H200, T = 1, R = 1: estimates of 0.62-0.91 for positions accepted at
    0.34-0.56, so hardware_aware drafted 7 where 5 paid); at R = 256 position 1 renews its memory
    every round or two. A round that verified nothing (plain decoding) reaches no position: it
    leaves the estimate as it is, neither fading the evidence nor bringing drafting back.

    The state is a few floats a position, kept in Python lists: the policies update and read it on
    the host every round, where a numpy call on ~8 entries costs more than the loop over them."""

    def __init__(self, memory: float = 256.0) -> None:
        if not (math.isfinite(float(memory)) and float(memory) >= 1.0):
            raise ValueError(f"memory must be a finite number of tries >= 1, got {memory}")
        self.memory = float(memory)
        self._fades: tuple[float, list[float]] = (self.memory, [])  # fade per try count (``_fade``)
        self.reset()

    def reset(self) -> None:
        self._hits: list[float] = []  # decayed acceptances per position
        self._tries: list[float] = []  # decayed tries per position
        self._sums: dict[int, list[float]] = {}  # ``_accepted_sums`` per γ, until the next update

    def rates(self, gamma: int) -> np.ndarray:
        """``ĉ_j`` for positions ``1..gamma``."""
        return np.array(self._rates(gamma), dtype=np.float64)

    def _rates(self, gamma: int) -> list[float]:
        rates = [(h + 1.0) / (t + 1.0) for h, t in zip(self._hits, self._tries)]
        return rates[:gamma] + [1.0] * (gamma - len(rates))  # never reached: the optimistic prior alone

    def accepted(self, gamma: int) -> list[float]:
        """``Σ_{j<=γ_d} Π_{i<=j} ĉ_i`` for ``γ_d = 0..gamma``: the drafts a row is expected to get
        accepted (``expected_tokens`` per row, less the anchor). Kept until an observed round
        changes the estimate (a plain round does not): the policies ask every round. Shared: the
        callers only read it."""
        sums = self._sums.get(gamma)
        if sums is None:
            sums = self._sums[gamma] = _accepted_sums(self._rates(gamma))
        return sums

    def observe(self, lengths: np.ndarray, accepted: np.ndarray) -> int:
        """Fold in a completed round; returns its accepted drafts in all (``Σ accepted``), counted on
        the way, for a caller that counts the round's tokens."""
        # Position j is reached when the row verified it and accepted the j - 1 before it, and
        # accepted when also accepted itself: counts of min(ℓ, n + 1) >= j and min(ℓ, n) >= j,
        # from a histogram or two (``_reach_counts``; no [R, γ] table: this runs every round).
        hits, tries, total = _reach_counts(lengths, accepted)
        if not tries:  # nothing verified: no position reached
            return total
        n = len(tries)
        if n > len(self._hits):  # positions reached for the first time
            new = [0.0] * (n - len(self._hits))
            self._hits, self._tries = self._hits + new, self._tries + new
        fade = self._fade(tries[0])  # position 1 has the most tries; each try fades the older ones
        self._hits = [fade[t] * h + a for t, h, a in zip(tries, self._hits, hits)] + self._hits[n:]
        self._tries = [fade[t] * w + t for t, w in zip(tries, self._tries)] + self._tries[n:]
        self._sums.clear()
        return total

    def _fade(self, most: int) -> list[float]:
        """``(1 - 1/memory) ** t`` for ``t = 0..most`` at least: numpy's power once for a table of
        them (read every round), which is also what the estimate always faded by (libm's ``pow``,
        Python's, differs from numpy's in the last ulp for a few per cent of the counts)."""
        memory, fade = self._fades
        if len(fade) <= most or memory != self.memory:
            keep = 1.0 - 1.0 / self.memory
            fade = (keep ** np.arange(max(2 * most, 256) + 1)).tolist()
            self._fades = (self.memory, fade)
        return fade


def _reach_counts(lengths: np.ndarray, accepted: np.ndarray) -> tuple[list[int], list[int], int]:
    """Per draft position ``j = 1..`` the deepest any row reached: how many rows accepted it and
    how many reached it (``position_counts``), as lists, both empty when no row verified a draft;
    and ``Σ accepted``. Histograms over the rows (each numpy call costs about a µs on the host), the
    rest over the few positions."""
    lengths = np.asarray(lengths, dtype=np.int64)
    accepted = np.asarray(accepted, dtype=np.int64)
    widths = np.bincount(lengths).tolist()
    if widths and widths[-1] == lengths.size:  # every row verified d drafts (a whole draft, a padded walk)
        # Position j <= d is then reached by the rows that accepted >= j - 1 drafts and accepted by
        # those that accepted >= j: one histogram of the accepted counts says both.
        # (Σ accepted = Σ_{k>=1} #(accepted >= k).)
        d, at_least = len(widths) - 1, list(accumulate(np.bincount(accepted).tolist()[::-1]))[::-1]
        tries = at_least[:d]
        return (at_least[1:] + [0])[: len(tries)], tries, sum(at_least[1:])
    tries = np.bincount(np.minimum(lengths, accepted + 1))
    hits = np.bincount(np.minimum(lengths, accepted), minlength=tries.size)
    return _at_least(hits.tolist()), _at_least(tries.tolist()), int(np.add.reduce(accepted))


def position_counts(lengths: np.ndarray, accepted: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Per draft position ``j = 1..n`` over rows that verified ``lengths`` drafts and accepted
    ``accepted`` of them: how many accepted it, and how many reached it (verified it and accepted
    the ``j - 1`` before it), as (hits, tries)."""
    hits, tries, _ = _reach_counts(lengths, accepted)
    pad = [0] * max(n - len(tries), 0)  # positions no row reached
    return np.array(hits[:n] + pad, dtype=np.int64), np.array(tries[:n] + pad, dtype=np.int64)


def _at_least(counts: list[int]) -> list[int]:
    """``#(values >= j)`` for ``j = 1..len(counts) - 1`` from ``counts[v] = #(values == v)``."""
    return list(accumulate(counts[:0:-1]))[::-1]


def _floats(values) -> list[float]:
    """A vector as a list of Python floats (the per-round path passes lists through)."""
    return values if isinstance(values, list) else np.asarray(values, dtype=np.float64).tolist()


def _accepted_sums(acceptance: list[float]) -> list[float]:
    """``Σ_{j<=γ_d} Π_{i<=j} ĉ_i`` for ``γ_d = 0..γ``: the drafts a row is expected to get accepted.
    Multiplied and added in order, as numpy's cumprod and cumsum do: the same floats."""
    return list(accumulate(accumulate(acceptance, operator.mul), initial=0.0))


def expected_tokens(acceptance: np.ndarray, rows: int) -> np.ndarray:
    """Tokens a round emits for ``γ_d = 0..γ``, every row verifying its whole draft:
    ``R · (1 + Σ_{j<=γ_d} Π_{i<=j} ĉ_i)``."""
    return np.array([rows * (1.0 + s) for s in _accepted_sums(_floats(acceptance))], dtype=np.float64)


def expected_rates(acceptance: np.ndarray, rows: int, cost: CostModel) -> np.ndarray:
    """Θ(γ_d) for ``γ_d = 0..γ`` (tokens per second) priced by the table:
    ``expected_tokens / T(R, γ_d)`` with ``T = CostModel.round_time``."""
    return expected_tokens(acceptance, rows) / cost.round_times(rows, np.size(acceptance))


def rows_bucket(rows: int) -> int:
    """The power of two at or above ``rows`` (the engines' graph buckets by default)."""
    rows = int(rows)
    return 1 << (rows - 1).bit_length() if rows > 1 else 1


def _sum(values: list[float]) -> float:
    """``np.sum`` of a short list, to the bit: numpy adds fewer than 8 terms in order (pairwise
    beyond), and a ratio off by an ulp could flip a near-tie the numpy version decided."""
    if len(values) >= 8:
        return float(np.sum(values))
    total = 0.0
    for v in values:
        total += v
    return total


class RoundClock:
    """What the engine's rounds cost, against what the cost table prices them at.

    The table is profiled apart from the run (steps or whole rounds of random prompts, no request
    ending), and the run's rounds can cost otherwise: rows moved as requests finish, the host's work
    per round outlasting the device's at high load, a plain round of an engine that carries a
    drafter. Per rows bucket and drafted length ``γ_d`` this keeps a decaying mean of measured / priced
    (``observe``, from completed rounds) and prices ``γ_d`` with the table times that ratio once it
    has ``min_timed`` rounds of it (``times``). ``choose`` takes the best rate so priced; and once the
    chosen length is timed, one round in ``explore_every`` runs the most promising length the clock
    has not timed yet, if its rate is within ``explore_share`` of the best one's, so a table that
    overprices a plain round (or underprices a draft) costs a few rounds, not the run. A length's
    timing goes stale once ``stale_after`` rounds of its bucket passed without it: it is dropped and
    the length priced by the others' ratio again (the table's order), so a few slow rounds do not
    rule out the table's best for the rest of the run (the H200, T = 0, R = 256, session -g: four
    γ_d = 3 rounds timed 10 % over the table kept both load-aware policies at 4, which fixed γ = 3
    beat by 2 % a token). A length once timed is not explored again: a stale one comes back only
    where the table ranks it best. Only completed rounds and round counters decide: the choice stays
    non-anticipating."""

    def __init__(
        self,
        decay: float = 0.9,
        min_timed: int = 2,
        explore_every: int = 8,
        explore_share: float = 0.8,
        stale_after: int = 32,
    ) -> None:
        if min(min_timed, explore_every, stale_after) < 1:
            raise ValueError(
                f"min_timed, explore_every and stale_after must be >= 1, got {min_timed}, {explore_every}, "
                f"{stale_after}"
            )
        self.decay, self.min_timed, self.explore_every = _decay(decay), int(min_timed), int(explore_every)
        self.explore_share, self.stale_after = float(explore_share), int(stale_after)
        self.reset()

    def reset(self) -> None:
        # rows bucket -> lists per drafted length (grown on demand; Python floats, as they are read
        # every round): Σ w·ratio, Σ w, rounds, the bucket's round count at the last one, and 1 once
        # timed (explored no more)
        self._stats: dict[int, list[list[float]]] = {}
        self._bucket_rounds: dict[int, int] = {}
        self._since_explore = 0
        # rows bucket -> {γ: ``_ratios``}, until the bucket's next observed round changes them
        self._priced: dict[int, dict[int, tuple[list[float], list[bool]]]] = {}
        # the last choice's rates, ratios and expected tokens (``Policy.plan_record``)
        self.last: PlanRecord | None = None

    def _ratios(self, rows: int, gamma: int) -> tuple[list[float], list[bool]]:
        """Per ``γ_d = 0..gamma`` at this rows bucket: measured / priced where timed (``min_timed``
        rounds, not stale), else the mean ratio of the timed lengths (1 where none is); and which
        are timed. Kept until the bucket's next observed round (its round count, which ages the
        timings, moves only then); the callers only read them."""
        bucket = rows_bucket(rows)
        priced = self._priced.get(bucket)
        if priced is None:
            priced = self._priced[bucket] = {}
        ratios = priced.get(gamma)
        if ratios is None:
            ratios = priced[gamma] = self._price(bucket, gamma + 1)
        return ratios

    def _price(self, bucket: int, size: int) -> tuple[list[float], list[bool]]:
        """``_ratios`` of ``size`` lengths from the bucket's stats."""
        stats = self._stats.get(bucket)
        if stats is None:
            return [1.0] * size, [False] * size
        sums, weights, rounds, last, _ = (column[:size] for column in stats)
        now, pad = self._bucket_rounds[bucket], [False] * (size - len(rounds))
        timed = [n >= self.min_timed and now - t <= self.stale_after for n, t in zip(rounds, last)] + pad
        if True not in timed:
            return [1.0] * size, timed
        own = [s / w if ok else 0.0 for s, w, ok in zip(sums, weights, timed)]
        mean = _sum([r for r, ok in zip(own, timed) if ok]) / timed.count(True)
        return [r if ok else mean for r, ok in zip(own, timed)] + [mean] * (size - len(own)), timed

    def _once(self, rows: int, gamma: int) -> list[bool]:
        """Per ``γ_d = 0..gamma`` at this rows bucket: whether it was ever timed."""
        once = self._stats.get(rows_bucket(rows), [[]] * 5)[4][: gamma + 1]
        return [o > 0 for o in once] + [False] * (gamma + 1 - len(once))

    def timed(self, rows: int, drafted: int) -> bool:
        return drafted >= 0 and self._ratios(rows, drafted)[1][drafted]

    def times(self, rows: int, gamma: int, cost: CostModel) -> np.ndarray:
        """``T(R, γ_d)`` for ``γ_d = 0..gamma`` (seconds): the table's, times the measured ratio
        where it is timed, else the mean ratio of the timed lengths of this bucket: a table off
        by one factor throughout (another machine, another load) keeps its order of the lengths."""
        return cost.round_times(rows, gamma) * np.array(self._ratios(rows, gamma)[0])

    def observe(self, rows: int, drafted: int, ms: float, cost: CostModel) -> None:
        """A completed round of ``rows`` rows that drafted ``drafted`` positions took ``ms``."""
        priced = cost.round_seconds(rows, drafted)[drafted]  # kept per (rows, length): no interpolation
        if not (ms > 0 and priced > 0):
            return
        bucket, m = rows_bucket(rows), int(drafted)
        stats = self._stats.get(bucket)
        if stats is None:
            stats = self._stats[bucket] = [[] for _ in range(5)]
        if len(stats[0]) <= m:
            for column in stats:
                column += [0.0] * (m + 1 - len(column))
        sums, weights, rounds, last, once = stats
        now = self._bucket_rounds[bucket] = self._bucket_rounds.get(bucket, 0) + 1
        self._priced.pop(bucket, None)
        if now - last[m] > self.stale_after + 1:  # stale: start this length's timing afresh
            sums[m] = weights[m] = rounds[m] = 0.0
        sums[m] = self.decay * sums[m] + 1e-3 * ms / priced
        weights[m] = self.decay * weights[m] + 1.0
        rounds[m] += 1
        last[m] = now
        if rounds[m] >= self.min_timed:
            once[m] = 1.0

    def choose(
        self, tokens: np.ndarray | list[float], rows: int, cost: CostModel, margin: float = 0.0
    ) -> int:
        """``γ_d`` for a round expected to emit ``tokens[γ_d]`` (``expected_tokens``); a draft only
        where its rate beats a plain round's by ``margin`` (``best_length``)."""
        tokens = _floats(tokens)
        gamma = len(tokens) - 1
        ratio, timed = self._ratios(rows, gamma)
        times = cost.round_seconds(rows, gamma)
        rates = [n / (t * r) for n, t, r in zip(tokens, times, ratio)]
        self.last = (rates, ratio, tokens)  # for a run's record (``Policy.plan_record``)
        best = _best(rates, margin)
        if not timed[best]:
            return best
        self._since_explore += 1
        if self._since_explore < self.explore_every:
            return best
        self._since_explore = 0
        floor, once = self.explore_share * rates[best], self._once(rows, len(rates) - 1)
        untimed = [m for m, rate in enumerate(rates) if not once[m] and rate >= floor]  # timed ones are once
        return max(untimed, key=rates.__getitem__) if untimed else best  # max: the first of equals


# A load-aware policy drafts only where the model expects a draft to beat plain decoding by this
# share. Near break-even the expected gain is within the model's error (session 2026-12-04-c:
# draft_aware at T = 1, R = 256 drafted where the table promised a few per cent and lost 10 % per
# user), and a draft spreads the rows' finishing times, which a batch pays for in its drain.
PLAIN_MARGIN = 0.05


def _decay(value: float) -> float:
    """A clock's weight of a round one round later."""
    if not 0.0 <= float(value) < 1.0:
        raise ValueError(f"decay must be in [0, 1), got {value}")
    return float(value)


def _margin(value: float, name: str = "plain_margin") -> float:
    if not (math.isfinite(float(value)) and float(value) >= 0):
        raise ValueError(f"{name} must be a finite share >= 0 (0.05: 5 %), got {value}")
    return float(value)


def best_length(rates: np.ndarray | list[float], margin: float = 0.0) -> int:
    """The drafted length of the best rate (the first max: the fewest drafts), 0 (a plain round)
    unless that rate beats the plain round's by ``margin`` (a share of it)."""
    return _best(_floats(rates), margin)


def _best(rates: list[float], margin: float) -> int:
    best = rates.index(max(rates))  # the first of equals
    return best if best == 0 or rates[best] >= (1.0 + margin) * rates[0] else 0


# A load-aware policy drafts after this many plain rounds in a row (``PlainProbe``), then after twice
# as many while probes find nothing, up to ``PROBE_LONGEST``: soon enough to end a lock on a stale
# estimate within a run, rare enough later to cost little where plain decoding is right.
PROBE_EVERY = 32
PROBE_LONGEST = 1024
PROBE_ROUNDS = 2  # drafting rounds a probe lasts: at R = 256, enough for the estimate to be mostly fresh


class PlainProbe:
    """Drafting tried for ``rounds`` rounds once ``every`` plain rounds ran in a row (then after
    longer streaks while probes find nothing). The acceptance estimate learns only from rounds
    that draft, so a policy that went plain on a low estimate keeps that estimate until something
    drafts: one unlucky stretch could rule speculation out for the rest of a run. On the H100
    (2026-12-06 and -b, T = 0, R = 256) both load-aware schedulers went plain for one of their
    three runs, where fixed γ = 3 ran 7 % above target-only at the load; the runs' plans show the
    estimate falling in rounds 7-15, while every answer of the batch, all started together, was
    at its tokens ~15-40, and the probe after 128 plain rounds landed in the same stretch of the
    next wave of requests (answers of up to 128 tokens: 128 plain rounds), so it found nothing.
    A probe drafts the length drafted last (the positions whose estimate made the policy stop;
    before any draft, the plan's best draft) and verifies it whole. ``lock_replay`` with such a
    stretch (``--phase-dip 15,40,0.8`` with the -b run's tables and acceptances, three runs): a first
    probe after 32 plain rounds rather than 128 brings both policies at T = 0, R = 256 from 4-5 %
    behind the best fixed length to 1-2 %; at T = 1, R = 256, where plain decoding is right,
    probes cost 0.8 % of the runs' time against none, 0.1 % more than with the first after 128
    (simulated, not measured). Each probe that does not bring drafting back doubles the wait for
    the next (up to ``longest``), and a round the plan drafts by itself sets it back to ``every``.
    ``every = 0``: never. Counters only: non-anticipating."""

    def __init__(
        self, every: int = PROBE_EVERY, rounds: int = PROBE_ROUNDS, longest: int = PROBE_LONGEST
    ) -> None:
        if int(every) < 0:
            raise ValueError(f"probe_every must be >= 0 plain rounds (0: never probe), got {every}")
        if int(rounds) < 1:
            raise ValueError(f"a probe lasts >= 1 round, got {rounds}")
        self.every, self.rounds = int(every), int(rounds)
        self.longest = max(int(longest), self.every)  # the longest wait between probes
        self.reset()

    def reset(self) -> None:
        self.fired = False  # whether the last call turned a plain round into a probe
        self.drafting = False  # whether the last call passed on the plan's own draft
        self._plain = 0  # plain rounds in a row
        self._left = 0  # the probe's rounds still to draft
        self._last = 0  # the length drafted last (0: none yet)
        self._wait = self.every  # plain rounds before the next probe

    def __call__(self, drafted: int, rates: list[float]) -> int:
        """``drafted`` as planned, or a probe's draft where this plain round ends a long enough
        streak or follows a probe's first round (``rates``: per length ``0..γ``)."""
        self.fired, self.drafting = False, drafted > 0
        if drafted or not self.every or len(rates) < 2:
            self._plain = self._left = 0
            if drafted:
                self._last, self._wait = drafted, self.every
            return drafted
        if not self._left:
            self._plain += 1
            if self._plain < self._wait:
                return 0
            self._plain, self._left = 0, self.rounds
            self._wait = min(2 * self._wait, self.longest)  # unless the plan drafts again
        self._left -= 1
        self.fired = True
        if 0 < self._last < len(rates):
            return self._last
        return max(range(1, len(rates)), key=rates.__getitem__)  # max: the first of equals


def plan_draft(
    acceptance: np.ndarray, rows: int, cost: CostModel, clock: RoundClock | None, margin: float = 0.0
) -> int:
    """``γ_d`` of the best expected rate, a draft only where it beats plain decoding by ``margin``
    (``best_length``), the rounds priced by the table, or by ``clock`` (which also explores) where the
    policy keeps one."""
    return _plan(_accepted_sums(_floats(acceptance)), rows, cost, clock, margin)


def _plan(
    accepted: list[float],
    rows: int,
    cost: CostModel,
    clock: RoundClock | None,
    margin: float,
    probe: PlainProbe | None = None,
    keep: float | None = None,
) -> int:
    """``plan_draft`` from the drafts a row is expected to get accepted (``_accepted_sums``): the
    tokens ``R · (1 + accepted)`` a round of each length is expected to emit, priced alike; a
    plain round may turn into ``probe``'s draft. Where the last round drafted by the plan's own
    choice, ``keep`` (when given) stands for ``margin``."""
    if keep is not None and probe is not None and probe.drafting:
        margin = keep
    tokens = [rows * (1.0 + s) for s in accepted]
    if clock is None:
        rates = [n / t for n, t in zip(tokens, cost.round_seconds(rows, len(tokens) - 1))]
        drafted = _best(rates, margin)
    else:
        drafted = clock.choose(tokens, rows, cost, margin)
        rates = clock.last[0]
    return drafted if probe is None else probe(drafted, rates)


# ---------------------------------------------------------------------------------------------
# policies
# ---------------------------------------------------------------------------------------------
class Policy:
    """``lengths(confidences [R, gamma], cost) -> l [R]`` (long, on the confidences' device)."""

    name: str = "policy"
    needs_confidence: bool = True  # reads the calibrated confidences (a drafter with a confidence head)
    needs_cost: bool = False  # reads the cost model (a profiled SPS table)
    lossless: bool = True  # non-anticipating (Appendix A): the output distribution is the target's

    def lengths(self, confidences: Tensor, cost: CostModel | None = None) -> Tensor:
        raise NotImplementedError

    def __call__(self, confidences: Tensor, cost: CostModel | None = None) -> Tensor:
        return self.lengths(confidences, cost)

    def draft_length(self, rows: int, gamma: int, cost: CostModel | None = None) -> int:
        """Positions to draft this round (0 = plain decoding), decided before drafting from
        completed rounds only; the default drafts the whole block."""
        return gamma

    def width(self, drafted: int) -> int | None:
        """The verify width of a round that drafted ``drafted`` positions (a bound on its
        lengths) when it is known before the confidences are looked at; None: it depends on
        them, and the engine reads ``max(lengths)`` back."""
        return None

    def reads_confidences(self) -> bool:
        """Whether this round's ``lengths`` or ``shadow_inputs`` read the confidences' values (asked
        after ``draft_length``). When not, the engine neither calibrates them (unless it records
        them) nor expects them: the policy gets a tensor of their shape."""
        return self.needs_confidence

    def plan_record(self) -> PlanRecord | None:
        """What decided the last ``draft_length``, for a run's record: the expected rate of each
        drafted length ``0..γ`` (tokens per second), the rounds' clock's measured / priced ratio it
        priced each at, and the tokens each was expected to emit (the round's rows, each
        ``1 + Σ â``); None (the default) for a policy that weighs no lengths. Shared lists: the
        caller only reads them."""
        return None

    def observe_round(self, lengths: np.ndarray, accepted: np.ndarray) -> None:
        """A completed round's verified lengths and accepted counts (live rows only)."""

    def shadow_inputs(self, confidences: Tensor, cost: CostModel | None = None) -> Tensor | None:
        """In a round whose width was known in advance: what the policy needs of this round's
        confidences to learn which lengths it would have chosen had it looked at them (a tensor
        with a row per request, typically the confidences themselves), copied to the host with the
        round's outcome (``observe_shadow``), never used for this round's verification; None (the
        default): nothing to learn. Lets a policy find out whether looking pays without paying a
        read-back, nor the host's launches of the look on the round's critical path."""
        return None

    def observe_shadow(self, inputs: np.ndarray) -> None:
        """A completed round's ``shadow_inputs`` (live rows only), right after its ``observe_round``."""

    def observe_time(self, ms: float) -> None:
        """A completed round's duration (ms on the device's timeline, idle gaps included; the
        host's clock on the CPU), right after its ``observe_round`` / ``observe_shadow``; not
        called for a round that met one-off work (its record's ``events``)."""

    def reset(self) -> None:
        """A new ``generate``: forget the state of the rounds in flight (stateless policies have
        none); what a policy learned about the drafter may carry over (``DraftAware``)."""

    @property
    def base(self) -> Policy:
        """The policy itself, under any wrapper (``Truncated``)."""
        return self

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({args})"


class Fixed(Policy):
    """Verify ``gamma`` draft tokens per request (``None``: the whole drafted block)."""

    name = "fixed"
    needs_confidence = False

    def __init__(self, gamma: int | None = None) -> None:
        if gamma is not None and gamma < 0:
            raise ValueError(f"gamma must be >= 0, got {gamma}")
        self.gamma = gamma
        self._full: dict[tuple, Tensor] = {}  # ``_filled``'s lengths per shape and device

    def lengths(self, confidences: Tensor, cost: CostModel | None = None) -> Tensor:
        if confidences.dim() != 2:
            raise ValueError(f"confidences must be [R, gamma], got shape {tuple(confidences.shape)}")
        R, G = confidences.shape
        g = G if self.gamma is None else self.gamma
        if g > G:
            raise ValueError(f"Fixed(gamma={g}) but the drafter proposed only {G} tokens per request")
        return _filled(self._full, R, g, confidences.device)

    def draft_length(self, rows: int, gamma: int, cost: CostModel | None = None) -> int:
        return gamma if self.gamma is None else min(self.gamma, gamma)  # nothing it will not verify

    def width(self, drafted: int) -> int | None:
        return drafted if self.gamma is None else min(self.gamma, drafted)


class Mtp1(Fixed):
    """One draft token per request (MTP-1-like); zero if nothing was drafted."""

    name = "mtp1"

    def __init__(self) -> None:
        super().__init__(gamma=1)

    def lengths(self, confidences: Tensor, cost: CostModel | None = None) -> Tensor:
        if (e := _empty(confidences)) is not None:
            return e
        return super().lengths(confidences, cost)


class Threshold(Policy):
    """Static threshold: the longest prefix whose survival ``a[r, j] >= threshold``.

    It drafts one position more than the longest prefix it verified in the last ``window``
    completed rounds (the whole block before any), so it neither drafts positions it will not
    verify nor makes the engine read the width back (a host round trip per round): the verify
    width is the drafted length, known before drafting. A prefix cut at that bound is truncated
    (lossless: the bound comes from completed rounds) and widens the next rounds by one."""

    name = "threshold"

    def __init__(self, threshold: float = 0.5, window: int = 4) -> None:
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {threshold}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.threshold = float(threshold)
        self.window = int(window)
        self._longest: deque[int] = deque(maxlen=self.window)

    def reset(self) -> None:
        self._longest.clear()

    def lengths(self, confidences: Tensor, cost: CostModel | None = None) -> Tensor:
        if (e := _empty(confidences)) is not None:
            return e
        ok = prefix_survival(confidences) >= self.threshold
        # cumprod keeps it a leading run even if a caller's rounding made `a` non-monotone.
        return torch.cumprod(ok.long(), dim=1).sum(dim=1)

    def draft_length(self, rows: int, gamma: int, cost: CostModel | None = None) -> int:
        if not self._longest:
            return gamma
        return min(gamma, 1 + max(self._longest))

    def width(self, drafted: int) -> int:
        return drafted

    def observe_round(self, lengths: np.ndarray, accepted: np.ndarray) -> None:
        if np.size(lengths):
            self._longest.append(int(np.max(lengths)))


class HardwareAware(Policy):
    """Algorithm 1 (§3.2.2), made to pay on an engine that pads and graphs its steps.

    Before drafting (``draft_length``) it chooses ``γ_d``, the positions to draft, by the expected rate
    of every choice (``expected_rates``: the acceptance of completed rounds and the cost of drafting,
    verifying and the overhead), ``0`` (a plain decoding round: no draft step, no verify width) when
    speculation cannot pay at this load by ``plain_margin`` (``keep_margin`` once drafting); the same
    choice as ``DraftAware``, its cost table corrected by the rounds' clock (``RoundClock``;
    ``round_clock=False``: the table alone), a long plain streak ended by a probe (``PlainProbe``,
    ``probe_every``; a probe verifies its whole draft). Then, if the verification it expects to save
    exceeds ``cost.readback_ms``, it walks the round's confidences (the engine reads the width back);
    otherwise every row verifies its whole draft (width known, nothing read back). The expected saving
    is the largest one (``T_verify`` of R rows 1 + γ_d wide minus 1 wide, ``CostModel.verify_rows_ms``)
    times the share of it that completed walked rounds realised (an average that halves the weight of
    older walks, each a whole batch's evidence; all of it before any walk): at a high τ the walk keeps
    nearly every block whole and stops paying for its read-back. While it does not pay, one round in
    ``explore_every`` walks in the shadow: the round verifies its whole draft like the others (nothing
    read back, the same cost as fixed γ), and its confidences come back with the round's outcome
    (``shadow_inputs``), to be walked on the host and update the estimate (``observe_shadow``), so it
    follows the workload for free. The estimate prices the walk with the cost table; the clock has the
    last word: per rows bucket and drafted length it times completed rounds that walked and rounds that
    verified the whole draft (tokens per ms on the device's timeline, ``observe_time``; an average that
    decays by ``decay`` a round) and, once it has ``min_timed`` walked rounds, walks only where walking
    was faster. Rounds of one length only: a walked round is weighed against the same draft verified
    whole, not against whole rounds of other lengths (the H100, T = 0, R = 64: walked rounds, mostly γ_d
    = 5 and 7, emitted 66 tokens/ms against whole rounds' 64, mostly γ_d = 3 and 4, and kept walks on in
    a run that lost 6.7 % to fixed γ = 3); until it has ``min_timed`` whole rounds of that length,
    against what one is expected to emit per ms (the acceptance estimate's tokens over the rounds'
    clock's price of the length), since whole rounds among walks come one in ``explore_every`` (the
    H100, T = 1, R = 256: 102 walked γ_d = 3 rounds at 93 tokens/ms against 8 whole ones at 116 over the
    point's runs, the first run at 0.56 x target-only's throughput). To keep both clocks current, one
    round in ``explore_every`` of those that could walk runs the other way: a whole-draft round among
    walks, a real walk where the clock ruled walks out (a shadow walk before any), so a table that
    misprices the walk (the read-back's idle device, the walk's own kernels, a flatter verify curve than
    profiled) costs a few rounds, not the run. Where the estimate agrees with the clock that walks do
    not pay, the exploring round walks in the shadow instead: a real walk would only pay its read-back
    to confirm it.
    Losslessness is untouched: every choice uses completed rounds only, and a shadow walk never
    shortens the round it sees.

    The walk stops at the first Θ that does not beat the best so far. With a ragged cost model it
    admits candidates ``(r, j)`` one by one in order of prefix survival; with a ``padded`` one
    (our engines) a step admits one whole depth, since the first candidate at a new depth pays the
    whole width for every row and a per-candidate walk would stop there (verify nothing) even
    when the depth pays. Lossless either way; globally optimal when Θ is unimodal on the path.
    ``lengths`` called without ``draft_length`` (the analytical replay) always walks."""

    name = "hardware_aware"
    needs_cost = True

    def __init__(
        self,
        check: bool = True,
        decay: float = 0.9,
        memory: float = 256.0,
        explore_every: int = 32,
        min_timed: int = 4,
        round_clock: bool = True,
        plain_margin: float = PLAIN_MARGIN,
        probe_every: int = PROBE_EVERY,
        keep_margin: float | None = None,
    ) -> None:
        if explore_every < 1:
            raise ValueError(f"explore_every must be >= 1, got {explore_every}")
        if min_timed < 1:
            raise ValueError(f"min_timed must be >= 1, got {min_timed}")
        self.plain_margin = _margin(plain_margin)
        self.keep_margin = self.plain_margin if keep_margin is None else _margin(keep_margin, "keep_margin")
        self.check = check
        self.explore_every = int(explore_every)
        self.min_timed = int(min_timed)
        self.decay = _decay(decay)  # the clocks' weight of a round one round later
        self._acceptance = AcceptanceEstimate(memory)
        self.memory = self._acceptance.memory
        self._rounds = RoundClock(decay) if round_clock else None  # what rounds of each γ_d really cost
        self._probe = PlainProbe(probe_every)  # a draft after a long plain streak
        self.probe_every = self._probe.every
        self._walk = True  # this round: decide from the confidences (the width is read back)
        self._shadow = False  # this round: verify the whole draft, walk in the shadow
        self._realised: float | None = None  # share of the largest saving walked rounds realised
        self._since_explore = 0
        # (rows bucket, γ_d, walked) -> decayed [tokens, ms, rounds] of completed drafting rounds
        self._clock: dict[tuple[int, int, bool], list[float]] = {}
        self._tokens = 0  # the tokens of the round observe_round just completed
        # (rows, γ_d, walked, cost) of launched rounds, oldest first; an engine has one or two in
        # flight, the bound only keeps a caller that never reports rounds from growing it.
        self._plans: deque = deque(maxlen=8)
        self._observed = None  # the plan observe_round just completed (for its observe_shadow)
        self._full: dict[tuple, Tensor] = {}  # ``_whole_draft``'s lengths per shape and device

    def reset(self) -> None:
        """A new ``generate``: the estimates carry over (see ``DraftAware.reset``); the rounds in
        flight are gone."""
        self._walk, self._shadow, self._observed = True, False, None
        self._plans.clear()

    def forget(self) -> None:
        """Drop the estimates too (a new drafter or workload)."""
        self._acceptance.reset()
        self._probe.reset()
        self._realised, self._since_explore = None, 0
        self._clock.clear()
        if self._rounds is not None:
            self._rounds.reset()

    def acceptance(self, gamma: int) -> np.ndarray:
        return self._acceptance.rates(gamma)

    def draft_length(self, rows: int, gamma: int, cost: CostModel | None = None) -> int:
        cost = _need_cost(self, cost)
        if rows <= 0 or gamma <= 0:
            return 0
        accepted = self._acceptance.accepted(gamma)
        drafted = _plan(accepted, rows, cost, self._rounds, self.plain_margin, self._probe, self.keep_margin)
        walk, shadow = False, False
        largest = self._largest_saving(rows, drafted, cost) if drafted > 0 else 0.0
        # A probe verifies its whole draft: it is there to measure the positions it drafts.
        if drafted > 0 and largest > cost.readback_ms and not self._probe.fired:  # a walk could pay
            clocked = self._clocked_walk(rows, drafted, cost)
            expected = largest * (1.0 if self._realised is None else self._realised)
            pays = expected > cost.readback_ms  # what the table and the walks' savings say
            walk = pays if clocked is None else clocked
            self._since_explore += 1
            if self._since_explore >= self.explore_every:  # this round runs the other way
                self._since_explore = 0
                # Not walking: a real walk only to time walks again where the estimate says they
                # pay and the clock alone ruled them out; else a shadow walk, which costs nothing.
                # (H100, T = 1, R = 64: walks saved nothing, yet one round in 32 walked for real,
                # at 0.4 of a whole-draft round's tokens per ms.)
                retime = pays and clocked is False
                walk, shadow = (False, False) if walk else (retime, not retime)
        self._walk, self._shadow = walk, shadow
        self._plans.append((rows, drafted, walk, cost))
        return drafted

    def plan_record(self) -> PlanRecord | None:
        return None if self._rounds is None else self._rounds.last

    @staticmethod
    def _largest_saving(rows: int, drafted: int, cost: CostModel) -> float:
        """The verification a walk saves at most: ``R`` rows ``1 + γ_d`` wide against 1 wide (ms)."""
        return cost.verify_rows_ms(rows, 1 + drafted) - cost.verify_rows_ms(rows, 1)

    def _clocked_walk(self, rows: int, drafted: int, cost: CostModel) -> bool | None:
        """Whether walked rounds of ``drafted`` positions at ``rows`` emitted more tokens per ms
        than whole-draft ones of the same length (timed, where the clock has ``min_timed`` of them,
        else ``_whole_rate``); None until it has ``min_timed`` walked ones."""
        bucket = rows_bucket(rows)
        walked, whole = self._clock.get((bucket, drafted, True)), self._clock.get((bucket, drafted, False))
        if walked is None or walked[2] < self.min_timed:
            return None
        if whole is not None and whole[2] >= self.min_timed:
            return bool(walked[0] / walked[1] > whole[0] / whole[1])
        return bool(walked[0] / walked[1] > self._whole_rate(rows, drafted, cost))

    def _whole_rate(self, rows: int, drafted: int, cost: CostModel) -> float:
        """Tokens per ms a round of ``rows`` rows verifying its whole ``drafted``-position draft is
        expected to emit: the acceptance estimate's tokens over the round's price (the table's,
        corrected by the rounds' clock where the policy keeps one)."""
        tokens = rows * (1.0 + self._acceptance.accepted(drafted)[drafted])
        seconds = (
            cost.round_seconds(rows, drafted)[drafted]
            if self._rounds is None
            else float(self._rounds.times(rows, drafted, cost)[drafted])
        )
        return tokens / (1e3 * seconds)

    def walk_state(self) -> dict:
        """What decides whether a round walks, as it stands: the share of the largest saving that
        walks realised (None before any), and per rows bucket the clock of walked and whole-draft
        rounds of each drafted length (tokens per ms, decayed; rounds timed). For a run's record:
        where walks go on though they cost more than they save, it says which of the two let them."""
        clock = [
            {"rows_bucket": b, "drafted": d, "walked": w, "tokens_per_ms": t / ms if ms > 0 else None,
             "rounds": int(n)}
            for (b, d, w), (t, ms, n) in sorted(self._clock.items(), key=lambda kv: (-kv[0][0], *kv[0][1:]))
        ]  # fmt: skip
        return {"realised": self._realised, "clock": clock}

    def width(self, drafted: int) -> int | None:
        return None if self._walk else drafted

    def reads_confidences(self) -> bool:
        return self._walk or self._shadow  # a whole-draft round reads none

    def lengths(self, confidences: Tensor, cost: CostModel | None = None) -> Tensor:
        cost = _need_cost(self, cost)
        if not self._walk:  # the width is the whole draft: every row verifies it at no extra cost
            return _whole_draft(self._full, confidences)
        if (e := _empty(confidences)) is not None:
            return e
        return self._walk_lengths(confidences, cost)

    def shadow_inputs(self, confidences: Tensor, cost: CostModel | None = None) -> Tensor | None:
        if not self._shadow or _empty(confidences) is not None:
            return None
        return confidences  # walked on the host once they arrive (``observe_shadow``), at the plan's cost

    def _walk_lengths(self, confidences: Tensor, cost: CostModel) -> Tensor:
        """Algorithm 1's lengths on this round's confidences (see the class docstring). A padded
        walk runs on the host: its width is read back anyway, and one copy of R x γ_d confidences
        costs less than launching the walk's dozen small kernels, which took the host 0.9 ms while
        the device idled (the H200, R = 64: ``lengths`` 0.90-0.92 ms in the slowest walk rounds,
        0.06-0.10 in whole-draft ones)."""
        R, G = confidences.shape
        if cost.padded:
            depth = int(_leading_run(depth_path(confidences.detach().cpu(), cost, cost.readback_ms)))
            return _filled(self._full, R, depth, confidences.device)
        rows, j, a_sorted = admission_order(confidences, keep_dead=True)
        theta = _live_path(a_sorted, j, R, cost, G)
        # Θ_best is always the previous path entry until the break, so the number admitted is
        # the length of the leading run of strict improvements (a dead candidate never is one).
        return _lengths_from_prefix(rows, j, _leading_run(theta), R, self.check)

    def observe_round(self, lengths: np.ndarray, accepted: np.ndarray) -> None:
        # each live row's accepted drafts + 1
        self._tokens = len(accepted) + self._acceptance.observe(lengths, accepted)
        # A round this policy did not plan (the analytical replay) teaches the estimate nothing.
        self._observed = self._plans.popleft() if self._plans else None  # launch order
        if self._observed is not None and self._observed[2]:  # walked: its lengths are the walk's
            self._learn(lengths)

    def observe_time(self, ms: float) -> None:
        if self._observed is not None and self._rounds is not None and not self._observed[2]:
            # Only rounds that verified their whole draft time γ_d: the plan counts the whole
            # draft's tokens, and a walk's shorter verify would make γ_d look cheap without the
            # tokens it cut (the H200, T = 0, R = 256: walked γ_d = 7 rounds 6 % under the table's
            # price, emitting 3.1 tokens a row where whole ones emit 3.6, so the plan drafted 7
            # in half the rounds and lost 11 % to fixed γ = 3 at that load).
            rows, drafted, _, cost = self._observed
            self._rounds.observe(rows, drafted, ms, cost)
        if self._observed is None or not self._observed[1] or not ms > 0:  # unplanned or plain
            return
        rows, drafted, walked, _ = self._observed
        key = (rows_bucket(rows), drafted, walked)  # the rows bucket: the engine's graphs, as RoundClock's
        sums = self._clock.get(key)  # tokens and ms decay, rounds count
        if sums is None:
            sums = self._clock[key] = [0.0, 0.0, 0.0]
        sums[0] = self.decay * sums[0] + self._tokens
        sums[1] = self.decay * sums[1] + ms
        sums[2] += 1

    def observe_shadow(self, inputs: np.ndarray) -> None:
        """``inputs``: the shadow round's confidences (live rows), walked here on the host."""
        if self._observed is not None and np.size(inputs):
            walked = self._walk_lengths(torch.from_numpy(np.ascontiguousarray(inputs)), self._observed[3])
            self._learn(walked.numpy())

    def _learn(self, walked: np.ndarray) -> None:
        """Fold the share of the largest saving that a walk's lengths realised into the estimate."""
        rows, drafted, _, cost = self._observed
        width = int(np.asarray(walked).max(initial=0))
        largest = self._largest_saving(rows, drafted, cost)
        saved = cost.verify_rows_ms(rows, 1 + drafted) - cost.verify_rows_ms(rows, 1 + width)
        share = min(max(saved / largest, 0.0), 1.0) if largest > 0 else 0.0
        prev = share if self._realised is None else self._realised
        self._realised = 0.5 * (prev + share)


class Retrospective(Policy):
    """NEGATIVE CONTROL, NOT LOSSLESS: Algorithm 1 without the break, i.e. the argmax of Θ over
    all prefixes of the sorted path on current confidences. Whether ``x_{r,k}`` is admitted then
    depends on ``a[r, k+1]``, which depends on ``x_{r,k}`` (Appendix A). For tests/diagnostics."""

    name = "retrospective"
    needs_cost = True
    lossless = False

    def __init__(self, check: bool = True) -> None:
        self.check = check

    def lengths(self, confidences: Tensor, cost: CostModel | None = None) -> Tensor:
        cost = _need_cost(self, cost)
        if (e := _empty(confidences)) is not None:
            return e
        R = confidences.shape[0]
        rows, j, a_sorted = admission_order(confidences, keep_dead=True)
        n = torch.argmax(_live_path(a_sorted, j, R, cost, confidences.shape[1]))  # first max: fewest tokens
        return _lengths_from_prefix(rows, j, n, R, self.check)


class AsyncTopK(Policy):
    """§5.2: admit the top-``K`` current candidates, ``K`` from an unconstrained search over the
    confidences of ``delay`` rounds ago.

    Timeline, one ``lengths`` call per round ``t`` with that round's confidences ``C_t``:
      1. the budget search runs on ``C_t`` (``K'_t`` = argmax of Θ over the sorted path, the
         ``Retrospective`` count) and is queued for round ``t + delay``; in a ZOS pipeline this
         is what the CPU prepares while the GPU runs the next steps;
      2. round ``t`` uses ``K_t = K'_{t-delay}``, or ``fallback`` while ``t < delay`` (``None`` =
         every drafted token, i.e. ``Fixed``);
      3. the first ``K_t`` candidates in the current sorted order are admitted (ties to smaller
         ``j``), dropping candidates whose prefix survival is 0.
    ``K`` counts draft tokens (anchors excluded) and is reused as a count when requests join or
    leave in between (clamped to what is available). Lossless for ``delay >= 1`` because ``K_t``
    does not depend on round ``t``'s draft tokens. ``delay=0`` degenerates to ``Retrospective``
    (not lossless) and is allowed only as a diagnostic.
    """

    name = "async_topk"
    needs_cost = True

    def __init__(self, delay: int = 2, fallback: int | None = None, check: bool = True) -> None:
        if delay < 0:
            raise ValueError(f"delay must be >= 0, got {delay}")
        if fallback is not None and fallback < 0:
            raise ValueError(f"fallback budget must be >= 0, got {fallback}")
        self.delay = int(delay)
        self.fallback = fallback
        self.check = check
        self._pending: deque[Tensor] = deque()  # 0-d budgets where they were searched (no read-back)

    def reset(self) -> None:
        self._pending.clear()

    @property
    def lossless(self) -> bool:
        return self.delay >= 1

    @property
    def pending(self) -> tuple[int, ...]:
        """Budgets already computed for the coming rounds, oldest first."""
        return tuple(int(k) for k in self._pending)

    def observe(self, confidences: Tensor, cost: CostModel) -> Tensor:
        """Queue the budget searched on ``confidences`` for use ``delay`` rounds later."""
        k = _search_budget(confidences, cost)
        self._pending.append(k)
        return k

    def budget(self, confidences: Tensor) -> Tensor | int:
        """Budget for the current round (consumes the queued one when it is due)."""
        if len(self._pending) > self.delay:
            return self._pending.popleft().to(confidences.device)
        R, G = confidences.shape
        return R * G if self.fallback is None else self.fallback

    def lengths(self, confidences: Tensor, cost: CostModel | None = None) -> Tensor:
        """One round: ``observe`` + ``budget`` + top-K admission (do not also call ``observe``)."""
        cost = _need_cost(self, cost)
        if confidences.dim() != 2:
            raise ValueError(f"confidences must be [R, gamma], got shape {tuple(confidences.shape)}")
        self.observe(confidences, cost)
        k = self.budget(confidences)
        if (e := _empty(confidences)) is not None:
            return e
        rows, j, a_sorted = admission_order(confidences, keep_dead=True)
        return _lengths_from_prefix(rows, j, k, confidences.shape[0], self.check, alive=a_sorted > 0)


class DraftAware(Policy):
    """Draft-aware scheduling (issue 18, after §3.2.2 and §5.2): before each round choose how many
    positions ``γ_d`` to draft, ``0`` (plain decoding: no draft step at all) when speculation
    cannot pay at this load, to maximise the round's expected token rate

        Θ(γ_d) = R · (1 + Σ_{j<=γ_d} â_j) / T(R, γ_d),
        T(R, γ_d) = T_draft(R, γ_d) + T_verify(R · (γ_d + 1)) + overhead,   T(R, 0) = T_verify(R),

    a global search over ``γ + 1`` values (``expected_rates``), a draft only where its Θ beats the plain
    round's by ``plain_margin`` (``PLAIN_MARGIN``); once the plan drafts, by ``keep_margin`` (default:
    the same), so a lower one keeps a stretch of low acceptance from stopping the drafts that keep the
    estimate current. ``â_j = Π_{i<=j} ĉ_i``, ``ĉ_i`` the acceptance of completed rounds
    (``AcceptanceEstimate``: the last ``memory`` tries of each position, one optimistic
    pseudo-acceptance, so the first rounds draft the whole block and measure it). These are the outcomes
    the confidences predict, observed exactly, for any drafter. ``T`` is the cost table's, corrected by
    what the engine's completed rounds took (``RoundClock``, ``observe_time``; off with
    ``round_clock=False``, for choices that must not depend on timing). Every row then verifies its
    ``γ_d`` drafts: the engines verify rows padded to the longest, so a shorter row would save nothing.
    After ``probe_every`` plain rounds in a row the next two rounds draft anyway (``PlainProbe``), so
    the estimate, which only drafting rounds update, cannot keep a run plain on a stale value.

    Lossless: ``γ_d`` is fixed before the round's draft exists (completed rounds only; the engines
    report round ``t`` while ``t + 1`` runs, so round ``t + 1`` is planned from rounds ``<= t - 1``),
    and verifying a whole draft is ``Fixed``.
    """

    name = "draft_aware"
    needs_confidence = False
    needs_cost = True

    def __init__(
        self,
        decay: float = 0.9,
        memory: float = 256.0,
        round_clock: bool = True,
        plain_margin: float = PLAIN_MARGIN,
        probe_every: int = PROBE_EVERY,
        keep_margin: float | None = None,
    ) -> None:
        self.plain_margin = _margin(plain_margin)
        self.keep_margin = self.plain_margin if keep_margin is None else _margin(keep_margin, "keep_margin")
        self._probe = PlainProbe(probe_every)  # a draft after a long plain streak
        self.probe_every = self._probe.every
        self._acceptance = AcceptanceEstimate(memory)
        self.memory = self._acceptance.memory
        self.decay = _decay(decay)  # the rounds clock's weight of a round one round later
        self.clock = RoundClock(self.decay) if round_clock else None
        self._plans: deque = deque(maxlen=8)  # (rows, γ_d, cost) of launched rounds, oldest first
        self._observed = None  # the plan observe_round just completed
        self._full: dict[tuple, Tensor] = {}  # ``_whole_draft``'s lengths per shape and device

    def reset(self) -> None:
        """A new ``generate``. The acceptance estimate and the clock carry over: they describe the
        drafter and the engine on this workload, not one run, and starting again from the
        optimistic prior would draft (and pay) a saturated load's first rounds only to learn it
        again; ``forget`` drops them. The rounds in flight are gone."""
        self._plans.clear()
        self._observed = None

    def forget(self) -> None:
        """Drop the acceptance estimate and the clock (a new drafter, workload or engine)."""
        self._acceptance.reset()
        self._probe.reset()
        if self.clock is not None:
            self.clock.reset()

    def acceptance(self, gamma: int) -> np.ndarray:
        """``ĉ_j`` for positions ``1..gamma``."""
        return self._acceptance.rates(gamma)

    def expected_rates(self, rows: int, gamma: int, cost: CostModel) -> np.ndarray:
        """Θ(γ_d) for ``γ_d = 0..gamma`` (tokens per second)."""
        return expected_rates(self.acceptance(gamma), rows, cost)

    def draft_length(self, rows: int, gamma: int, cost: CostModel | None = None) -> int:
        cost = _need_cost(self, cost)
        if rows <= 0 or gamma <= 0:
            return 0
        accepted = self._acceptance.accepted(gamma)
        drafted = _plan(accepted, rows, cost, self.clock, self.plain_margin, self._probe, self.keep_margin)
        self._plans.append((rows, drafted, cost))
        return drafted

    def plan_record(self) -> PlanRecord | None:
        return None if self.clock is None else self.clock.last

    def width(self, drafted: int) -> int:
        return drafted

    def lengths(self, confidences: Tensor, cost: CostModel | None = None) -> Tensor:
        return _whole_draft(self._full, confidences)

    def observe_round(self, lengths: np.ndarray, accepted: np.ndarray) -> None:
        self._acceptance.observe(lengths, accepted)
        self._observed = self._plans.popleft() if self._plans else None  # launch order

    def observe_time(self, ms: float) -> None:
        if self.clock is not None and self._observed is not None:
            rows, drafted, cost = self._observed
            self.clock.observe(rows, drafted, ms, cost)


class Truncated(Policy):
    """Cap the drafted block at ``gamma`` positions before the inner policy sees it, so every
    policy of a sweep chooses from the same γ (e.g. a γ=7 drafter evaluated as DSpark-5)."""

    def __init__(self, inner: Policy, gamma: int) -> None:
        self.inner, self.gamma = inner, int(gamma)

    @property
    def name(self) -> str:
        return f"{self.inner.name}[:{self.gamma}]"

    @property
    def needs_confidence(self) -> bool:
        return self.inner.needs_confidence

    @property
    def needs_cost(self) -> bool:
        return self.inner.needs_cost

    @property
    def lossless(self) -> bool:
        return self.inner.lossless

    @property
    def base(self) -> Policy:
        return self.inner.base

    def lengths(self, confidences: Tensor, cost: CostModel | None = None) -> Tensor:
        return self.inner.lengths(confidences[:, : self.gamma], cost)

    def draft_length(self, rows: int, gamma: int, cost: CostModel | None = None) -> int:
        return self.inner.draft_length(rows, min(gamma, self.gamma), cost)

    def width(self, drafted: int) -> int | None:
        return self.inner.width(min(drafted, self.gamma))

    def reads_confidences(self) -> bool:
        return self.inner.reads_confidences()

    def plan_record(self) -> PlanRecord | None:
        return self.inner.plan_record()

    def observe_round(self, lengths: np.ndarray, accepted: np.ndarray) -> None:
        self.inner.observe_round(lengths, accepted)

    def shadow_inputs(self, confidences: Tensor, cost: CostModel | None = None) -> Tensor | None:
        return self.inner.shadow_inputs(confidences[:, : self.gamma], cost)

    def observe_shadow(self, inputs: np.ndarray) -> None:
        self.inner.observe_shadow(inputs)

    def observe_time(self, ms: float) -> None:
        self.inner.observe_time(ms)

    def reset(self) -> None:
        self.inner.reset()

    def forget(self) -> None:
        getattr(self.inner, "forget", lambda: None)()


# ---------------------------------------------------------------------------------------------
# the one factory
# ---------------------------------------------------------------------------------------------
POLICIES: dict[str, type[Policy]] = {
    "fixed": Fixed,
    "mtp1": Mtp1,
    "threshold": Threshold,
    "hardware_aware": HardwareAware,
    "async_topk": AsyncTopK,
    "draft_aware": DraftAware,
    "retrospective": Retrospective,
}
# Sweep names that carry their argument: fixed_3, threshold_0.3.
_SWEEP_NAME = re.compile(r"(fixed|threshold)_([0-9.]+)")
_SWEEP_ARG = {"fixed": ("gamma", int), "threshold": ("threshold", float)}
# Keys of a policy config that configure the run, not the policy (the stage loads the cost model).
_RUN_KEYS = {"name", "cost_table"}


def build_policy(
    spec: str | Mapping[str, Any],
    *,
    gamma: int | None = None,
    block: int | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> Policy:
    """The one way to make a policy from configuration.

    ``spec``: a policy config (conf/policy/*.yaml, e.g. ``{name: threshold, threshold: 0.5}``; its
    keys are the policy's arguments) or a sweep name: ``fixed`` (the whole block), ``fixed_<g>``,
    ``mtp1``, ``threshold``, ``threshold_<t>``, ``hardware_aware``, ``async_topk``,
    ``draft_aware``, ``retrospective`` (not lossless: diagnostics only), each optionally followed by
    ``:<argument>=<value>`` pairs (``draft_aware:probe_every=128``: a variant to run beside the
    default in one comparison). Names are case- and dash-insensitive.
    ``defaults``: arguments for the policies that take them when the spec leaves them out (the
    others ignore them), e.g. the schedule's ``threshold`` and ``delay``. ``gamma``: the longest
    draft any policy may verify (a longer fixed length is refused); when the drafter's ``block`` is
    longer, the policy sees only the first ``gamma`` positions (``Truncated``).
    Mistakes raise ConfigError naming the policy."""
    args = _policy_args(spec)
    label = str(spec) if isinstance(spec, str) else args["name"]
    cls = POLICIES.get(args.pop("name"))
    if cls is None:
        raise ConfigError(
            f"unknown policy {label!r}: use fixed, fixed_<g>, mtp1, threshold, threshold_<t>, "
            "hardware_aware, async_topk, draft_aware (or retrospective, a non-lossless diagnostic)"
        )
    takes = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    unknown = sorted(set(args) - set(takes) - _RUN_KEYS)
    if unknown:
        raise ConfigError(f"policy {label}: it takes {takes or 'no arguments'}, not {unknown}")
    kwargs = {k: v for k, v in (defaults or {}).items() if k in takes}
    kwargs.update({k: v for k, v in args.items() if k in takes})
    try:
        policy = cls(**kwargs)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"policy {label}: {err}") from None
    longest = getattr(policy, "gamma", None)
    if gamma is not None and longest is not None and longest > gamma:
        raise ConfigError(f"policy {label}: γ={longest} exceeds the draft length gamma={gamma}")
    if gamma is not None and block is not None and gamma < block:
        policy = Truncated(policy, gamma)
    return policy


def _literal(text: str) -> int | float | bool | str:
    """A policy argument written in a name (``key=value``): an int, a float, true / false, or the text."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _policy_args(spec: str | Mapping[str, Any]) -> dict[str, Any]:
    """``{"name": <normalised>, <argument>: <value>, …}`` from a config mapping or a sweep name."""
    if isinstance(spec, DictConfig):
        spec = OmegaConf.to_container(spec, resolve=True)
    if isinstance(spec, Mapping):
        args = dict(spec)
        if "name" not in args:
            raise ConfigError(f"policy config {args} has no name")
    else:
        name, *pairs = str(spec).split(":")
        args = {"name": name}
        for pair in pairs:
            key, eq, value = pair.partition("=")
            if not (eq and key.strip() and value.strip()):
                raise ConfigError(
                    f"policy {spec!r}: '{pair}' is not <argument>=<value> (e.g. draft_aware:probe_every=128)"
                )
            args[key.strip()] = _literal(value.strip())
    args["name"] = str(args["name"]).strip().lower().replace("-", "_")
    m = _SWEEP_NAME.fullmatch(args["name"])
    if m:
        key, kind = _SWEEP_ARG[m.group(1)]
        if key in args:
            raise ConfigError(f"policy {spec}: {key} given twice (by the name and as an argument)")
        args["name"] = m.group(1)
        try:
            args[key] = kind(m.group(2))
        except ValueError:
            raise ConfigError(f"policy {spec}: '{m.group(2)}' is not a {kind.__name__}") from None
    return args
