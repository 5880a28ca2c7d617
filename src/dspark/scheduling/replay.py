"""Throughput / interactivity frontier of verification-length policies (paper §5.3-5.4, Figs. 7-8),
analytically: one point ``(concurrency R, aggregate throughput, tok/s/user, budget, τ)`` per policy
and concurrency from recorded engine rounds replayed against a cost table, in seconds on a CPU.
(The measured frontier runs the engine itself: ``dspark.bench.measure``.)

``replay``: A round recorded with the *whole* drafted block verified (``proposed == drafted``, i.e.
``python -m dspark.evaluate policy=fixed policy.gamma=null``) tells the outcome of every draft
position: its first rejection index ``n``. The rejection sampler decides position ``k`` from the
draft token, the two distributions and one uniform, none of which depend on how many positions
are verified, so a policy that had verified ``ℓ' <= γ`` would have accepted ``min(ℓ', n)`` and
emitted ``τ' = min(ℓ', n) + 1`` tokens. Rounds verified at ``ℓ < γ`` only say ``n`` for
``ℓ' <= ℓ`` and are refused.

Concurrency is simulated by R slots, each replaying one recorded request's rounds in order;
when a request runs out of rounds its slot takes the next request (a seeded shuffle, skipping
requests already running while others are left, so a batch holds distinct requests where the
pool allows). Keeping each request's rounds consecutive gives ``async_topk`` the round-to-round
correlation its two-rounds-old budget relies on in serving. Every policy sees the same batches
(common random numbers), so differences between policies are not sampling noise of the batches.
For each batch the policy chooses ``ℓ [R]`` from the confidences (load-aware policies also see
the cost), the target verifies ``B = R + Σℓ`` tokens, and the round takes
``cost.step_time(B, R)`` seconds. Aggregates are ratios of sums over the simulated rounds:
throughput = Σ τ' / Σ step time (tokens per second of decoding, as a server would count them),
tok/s/user = throughput / R (each slot advances once per round), budget = mean ℓ (draft tokens
verified per request per round; the paper's Fig. 8 counts the anchor too, i.e. budget + 1),
τ = mean τ'. The first ``warmup`` rounds (``async_topk``'s fallback rounds) are not counted, for
any policy.

The replay is exact per round, but it is still a replay: a different ``ℓ'`` would have led the
request down another trajectory with other confidences later on; the recorded distribution of
(confidences, outcome) per round stands in for it. Prefill and request arrival are not modelled.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..artifacts import EvaluationFolder, read_rounds
from ..calibration.sts import Calibration
from ..core.errors import DataError
from ..core.progress import progress_bar
from .cost import CostModel
from .policies import Policy

__all__ = [
    "ReplayError",
    "ReplayRounds",
    "dominance",
    "load_rounds",
    "replay",
    "rounds_from_records",
    "stream_batches",
]

_REQUIRED = ("request", "round", "drafted", "proposed", "accepted", "accept_flags")


class ReplayError(ValueError):
    """Recorded rounds that cannot be replayed; the message says what to change."""


# ---------------------------------------------------------------------------------------------
# recorded rounds
# ---------------------------------------------------------------------------------------------
@dataclass
class ReplayRounds:
    """Recorded rounds as arrays: ``confidence [N, γ]`` (calibrated c_k; None when the drafter had
    no confidence head), ``accepted [N]`` (first rejection index with the whole block verified),
    ``sequences``: per request, its rows in round order."""

    confidence: np.ndarray | None
    accepted: np.ndarray
    sequences: list[np.ndarray]
    gamma: int
    source: str = ""

    def __len__(self) -> int:
        return int(self.accepted.shape[0])


def _get(rec, key, default=None):
    return rec.get(key, default) if isinstance(rec, Mapping) else getattr(rec, key, default)


def rounds_from_records(records: Iterable, source: str = "rounds", calibration=None) -> ReplayRounds:
    """Validate RoundRecords (objects or the dicts of ``rounds.jsonl``) and pack them.

    ``calibration``: a ``Calibration`` (or bare STS temperatures) to recalibrate from
    ``confidence_logits`` (c_k = σ(z_k / T_k + b_k)) instead of the recorded ``confidence``."""
    calibration = Calibration.of(calibration)
    temperatures = offsets = None
    if calibration is not None:
        temperatures, offsets = calibration.temperatures, calibration.biases
    conf_rows, acc, keys = [], [], []
    gammas: set[int] = set()
    short, first_short, no_conf = 0, None, 0
    for i, rec in enumerate(records):
        where = f"{source}: record {i + 1}"
        missing = [k for k in _REQUIRED if _get(rec, k, ...) is ...]
        if missing:
            raise ReplayError(f"{where} lacks {missing}: not an engine RoundRecord (rounds.jsonl)")
        drafted, proposed, n = (
            int(_get(rec, "drafted")),
            int(_get(rec, "proposed")),
            int(_get(rec, "accepted")),
        )
        flags = list(_get(rec, "accept_flags"))
        if proposed != drafted:
            short += 1
            first_short = first_short or (_get(rec, "request"), _get(rec, "round"), proposed, drafted)
            continue
        lead = next((k for k, f in enumerate(flags) if not f), len(flags))
        if len(flags) != proposed or not 0 <= n <= proposed or lead != n:
            raise ReplayError(
                f"{where}: inconsistent outcome (accepted={n}, proposed={proposed}, "
                f"{len(flags)} accept_flags with {lead} leading accepts)"
            )
        gammas.add(drafted)
        if temperatures is not None:
            z = _get(rec, "confidence_logits")
            if z is None:
                no_conf += 1
                c = None
            else:
                if len(z) != len(temperatures):
                    raise ReplayError(
                        f"{where}: {len(z)} confidence logits, {len(temperatures)} calibration temperatures"
                    )
                c = [1.0 / (1.0 + math.exp(-(zk / t + b))) for zk, t, b in zip(z, temperatures, offsets)]
        else:
            c = _get(rec, "confidence")
            no_conf += c is None
        if c is not None and len(c) != drafted:
            raise ReplayError(f"{where}: {len(c)} confidences for a block of {drafted}")
        conf_rows.append(c)
        acc.append(n)
        keys.append((str(_get(rec, "benchmark", "")), str(_get(rec, "request")), int(_get(rec, "round"))))
    if short:
        req, rnd, p, d = first_short
        raise ReplayError(
            f"{source}: {short} of {short + len(acc)} rounds verified fewer draft tokens than drafted "
            f"(e.g. request {req} round {rnd}: {p} of {d}); analytical replay needs the outcome of every "
            "draft position: record the rounds with the whole block verified "
            "(python -m dspark.evaluate policy=fixed policy.gamma=null)"
        )
    if not acc:
        raise ReplayError(f"{source}: no rounds recorded")
    if len(gammas) != 1:
        raise ReplayError(
            f"{source}: rounds of different block sizes {sorted(gammas)}; replay one drafter at a time"
        )
    if 0 < no_conf < len(acc):
        raise ReplayError(f"{source}: {no_conf} of {len(acc)} rounds lack confidences")
    gamma = gammas.pop()
    confidence = None if no_conf else np.asarray(conf_rows, dtype=np.float64).reshape(len(acc), gamma)
    if confidence is not None and not ((confidence >= 0) & (confidence <= 1)).all():
        raise ReplayError(f"{source}: confidences outside [0, 1] (NaN?)")
    by_req: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for row, (bench, req, rnd) in enumerate(keys):
        by_req.setdefault((bench, req), []).append((rnd, row))
    sequences = [np.array([row for _, row in sorted(v)], dtype=np.int64) for _, v in sorted(by_req.items())]
    return ReplayRounds(confidence, np.asarray(acc, dtype=np.int64), sequences, gamma, source)


def load_rounds(paths, calibration=None) -> ReplayRounds:
    """``rounds.jsonl`` files or evaluation folders holding one (a path or a list of them),
    recalibrated by ``calibration`` as ``rounds_from_records`` does."""
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    if not paths:
        raise ReplayError("rounds is empty: rounds=<evaluation folder or rounds.jsonl>")
    records = []
    for p in paths:
        path = Path(str(p)).expanduser()
        if path.is_dir():
            path = EvaluationFolder(path).rounds_path
        if not path.is_file():
            raise ReplayError(f"rounds={p}: no rounds.jsonl there (python -m dspark.evaluate writes one)")
        try:
            for rec in read_rounds(path):
                # Requests of different files never share a slot sequence.
                rec["benchmark"] = f"{path}:{rec.get('benchmark', '')}"
                records.append(rec)
        except DataError as err:
            raise ReplayError(str(err)) from None
    source = str(paths[0]) if len(paths) == 1 else f"{len(paths)} rounds files"
    return rounds_from_records(records, source, calibration)


def stream_batches(
    sequences: Sequence[np.ndarray], R: int, steps: int, rng: np.random.Generator
) -> Iterator[np.ndarray]:
    """``steps`` batches of ``R`` row indices: R slots, each replaying one request's rounds in order
    (continuous batching). Slots start at a random round of their first request so the batch is
    in steady state from the first step, not all at round 0."""
    if R < 1:
        raise ValueError(f"concurrency must be >= 1, got {R}")
    idle = list(range(len(sequences)))  # requests not in any slot; swap-remove keeps it O(1)
    where = {s: i for i, s in enumerate(idle)}
    running: dict[int, int] = {}  # request -> slots holding it

    def take() -> int:
        if idle:  # a request not running: a batch holds distinct requests while the pool allows
            i = int(rng.integers(len(idle)))
            s, last = idle[i], idle[-1]
            idle[i], where[last] = last, i
            idle.pop()
            del where[s]
        else:
            s = int(rng.integers(len(sequences)))
        running[s] = running.get(s, 0) + 1
        return s

    def release(s: int) -> None:
        running[s] -= 1
        if not running[s]:
            del running[s]
            where[s] = len(idle)
            idle.append(s)

    slots = []
    for _ in range(R):
        s = take()
        slots.append([s, int(rng.integers(len(sequences[s])))])
    for _ in range(steps):
        yield np.fromiter((sequences[s][p] for s, p in slots), dtype=np.int64, count=R)
        for slot in slots:
            slot[1] += 1
            if slot[1] >= len(sequences[slot[0]]):
                release(slot[0])
                slot[0], slot[1] = take(), 0


def replay(
    rounds: ReplayRounds,
    policies: Mapping[str, Policy],
    cost: CostModel,
    concurrency: Sequence[int],
    steps: int = 400,
    seed: int = 0,
    warmup: int = 2,
    outcome: str = "recorded",
    per_batch: bool = False,
    progress: bool = False,
) -> dict[str, list[dict]]:
    """Frontier points per policy (see the module docstring).

    ``outcome="recorded"``: τ' = min(ℓ', n) + 1 from the recorded first rejection. ``"expected"``:
    τ' = 1 + Σ_{j<=ℓ'} a_j from the calibrated confidences (noise-free, exact when calibrated).
    ``per_batch``: also return each counted batch's ``(Σ τ', step time)`` under ``"batches"``.
    """
    if outcome not in ("recorded", "expected"):
        raise ValueError(f"outcome must be 'recorded' or 'expected', got {outcome!r}")
    N, G = len(rounds), rounds.gamma
    conf = rounds.confidence
    if conf is None:
        needy = [n for n, p in policies.items() if p.needs_confidence]
        if needy or outcome == "expected":
            raise ReplayError(
                f"{rounds.source}: the rounds carry no confidences (drafter without a confidence head); "
                f"{needy or 'outcome=expected'} need them: replay only fixed/mtp1 policies"
            )
        conf = np.ones((N, G))
    # prefix[r, l] = Σ_{j<=l} a_{r,j}: the expected accepted count at length l.
    prefix = np.concatenate([np.zeros((N, 1)), np.cumsum(np.cumprod(conf, axis=1), axis=1)], axis=1)
    conf_t = torch.from_numpy(np.ascontiguousarray(conf))
    out: dict[str, list[dict]] = {name: [] for name in policies}
    bar = progress_bar(len(concurrency) * len(policies), "replay", progress)
    for R in concurrency:
        R = int(R)
        rng = np.random.default_rng([int(seed), R])
        batches = list(stream_batches(rounds.sequences, R, steps + warmup, rng))
        for name, pol in policies.items():
            pol.reset()
            taus, sizes = [], []
            for t, idx in enumerate(batches):
                ell = pol.lengths(conf_t[idx], cost).numpy()
                if t < warmup:
                    continue
                if outcome == "recorded":
                    taus.append(float(np.minimum(ell, rounds.accepted[idx]).sum()) + R)
                else:
                    taus.append(float(prefix[idx, ell].sum()) + R)
                sizes.append(R + int(ell.sum()))
            tau = np.asarray(taus)
            dt = np.asarray(cost.step_time(np.asarray(sizes, dtype=np.float64), np.full(len(sizes), R)))
            thr = float(tau.sum() / dt.sum())
            counted = R * len(taus)
            point = {
                "concurrency": R,
                "throughput": thr,
                "tps_per_user": thr / R,
                "budget": (sum(sizes) - counted) / counted,
                "tau": float(tau.sum()) / counted,
            }
            if per_batch:
                point["batches"] = list(zip(taus, dt.tolist()))
            out[name].append(point)
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    return out


def dominance(frontier: Mapping[str, list[dict]], policy: str, against: Iterable[str]) -> list[dict]:
    """Points of the ``against`` policies that no point of ``policy`` matches or beats in both
    throughput and tok/s/user (an empty list: ``policy``'s frontier dominates theirs)."""
    mine = frontier[policy]
    misses = []
    for other in against:
        for p in frontier[other]:
            if not any(
                q["throughput"] >= p["throughput"] and q["tps_per_user"] >= p["tps_per_user"] for q in mine
            ):
                same = next((q for q in mine if q["concurrency"] == p["concurrency"]), None)
                misses.append(
                    {
                        "policy": other,
                        "concurrency": p["concurrency"],
                        "throughput": p["throughput"],
                        "tps_per_user": p["tps_per_user"],
                        f"{policy}_throughput_same_R": None if same is None else same["throughput"],
                    }
                )
    return misses
