"""Throughput / interactivity frontier of verification-length policies (paper §5.3-5.4, Figs. 7-8).

Two ways to get one point ``(concurrency R, aggregate throughput, tok/s/user, budget, τ)`` per
policy and concurrency:

**Analytical** (``replay``): replay recorded engine rounds against a cost table, in seconds on a
CPU. A round recorded with the *whole* drafted block verified (``proposed == drafted``, i.e.
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

**Measured** (``measure``): run the real ``Engine`` over a prompt set at each R and time its
decode rounds (``EngineResult.steps``); ``profile_target`` / ``profile_drafter`` time the
target's verification forward and the drafter's proposal for the cost table.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..artifacts import EvaluationFolder, read_rounds
from ..core.errors import DataError
from .cost import CostModel
from .policies import AsyncTopK, Fixed, HardwareAware, Mtp1, Policy, Retrospective, Threshold

log = logging.getLogger(__name__)

__all__ = [
    "ReplayError",
    "ReplayRounds",
    "Truncated",
    "dominance",
    "load_rounds",
    "make_policy",
    "measure",
    "profile_drafter",
    "profile_target",
    "replay",
    "rounds_from_records",
    "settle_profile",
    "stream_batches",
]

NEEDS_CONFIDENCE = {"threshold", "hardware_aware", "async_topk", "retrospective"}
NEEDS_COST = {"hardware_aware", "async_topk", "retrospective"}
_REQUIRED = ("request", "round", "drafted", "proposed", "accepted", "accept_flags")


class ReplayError(ValueError):
    """Recorded rounds (or a policy spec) that cannot be replayed; the message says what to change."""


# ---------------------------------------------------------------------------------------------
# policies by name
# ---------------------------------------------------------------------------------------------
class Truncated(Policy):
    """Cap the drafted block at ``gamma`` positions before the inner policy sees it, so every
    policy of a sweep chooses from the same γ (e.g. a γ=7 drafter evaluated as DSpark-5)."""

    def __init__(self, inner: Policy, gamma: int) -> None:
        self.inner, self.gamma = inner, int(gamma)
        self.name = inner.name  # the engine looks policies up by name (needs cost / confidence)

    def lengths(self, confidences: Tensor, cost: CostModel | None = None) -> Tensor:
        return self.inner.lengths(confidences[:, : self.gamma], cost)

    def reset(self) -> None:
        self.inner.reset()


def base_name(spec: str) -> str:
    """``fixed_3`` -> ``fixed``, ``threshold_0.3`` -> ``threshold``."""
    key = str(spec).strip().lower().replace("-", "_")
    m = re.fullmatch(r"(fixed|threshold)_([0-9.]+)", key)
    return m.group(1) if m else key


def make_policy(
    spec: str, gamma: int, block: int | None = None, threshold: float = 0.5, delay: int = 2
) -> Policy:
    """A policy from its sweep name: ``fixed`` (the whole γ), ``fixed_<g>``, ``mtp1``, ``threshold``
    (``threshold`` value) or ``threshold_<t>``, ``hardware_aware``, ``async_topk`` (``delay``),
    ``retrospective`` (not lossless: diagnostics only). ``block``: the drafter's block size;
    when larger than ``gamma`` the policy is wrapped in ``Truncated``."""
    key = str(spec).strip().lower().replace("-", "_")
    m = re.fullmatch(r"(fixed|threshold)_([0-9.]+)", key)
    try:
        if m and m.group(1) == "fixed":
            g = int(m.group(2))
            if g > gamma:
                raise ReplayError(f"policy {spec}: γ={g} exceeds the draft length gamma={gamma}")
            pol: Policy = Fixed(g)
        elif m:
            pol = Threshold(float(m.group(2)))
        elif key == "fixed":
            pol = Fixed(None)
        elif key == "mtp1":
            pol = Mtp1()
        elif key == "threshold":
            pol = Threshold(float(threshold))
        elif key == "hardware_aware":
            pol = HardwareAware(check=False)
        elif key == "async_topk":
            pol = AsyncTopK(delay=int(delay), check=False)
        elif key == "retrospective":
            pol = Retrospective(check=False)
        else:
            raise ReplayError(
                f"unknown policy {spec!r}: use fixed, fixed_<g>, mtp1, threshold, threshold_<t>, "
                "hardware_aware, async_topk (or retrospective, a non-lossless diagnostic)"
            )
    except ValueError as err:
        if isinstance(err, ReplayError):
            raise
        raise ReplayError(f"policy {spec}: {err}") from None
    if block is not None and gamma < block:
        pol = Truncated(pol, gamma)
    return pol


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


def rounds_from_records(
    records: Iterable, source: str = "rounds", temperatures: Sequence[float] | None = None
) -> ReplayRounds:
    """Validate RoundRecords (objects or the dicts of ``rounds.jsonl``) and pack them.

    ``temperatures``: STS temperatures to recalibrate from ``confidence_logits`` (c_k = σ(z_k/T_k))
    instead of the recorded ``confidence``."""
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
                c = [1.0 / (1.0 + math.exp(-zk / t)) for zk, t in zip(z, temperatures)]
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


def load_rounds(paths, temperatures: Sequence[float] | None = None) -> ReplayRounds:
    """``rounds.jsonl`` files or evaluation folders holding one (a path or a list of them)."""
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
    return rounds_from_records(records, source, temperatures)


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
        needy = [n for n, p in policies.items() if p.name in NEEDS_CONFIDENCE]
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
    bar = _bar(len(concurrency) * len(policies), "replay", progress)
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


# ---------------------------------------------------------------------------------------------
# measured mode
# ---------------------------------------------------------------------------------------------
def measure(
    target,
    drafter,
    policies: Mapping[str, Policy],
    concurrency: Sequence[int],
    prompts: Sequence[Sequence[int]],
    *,
    cost: CostModel | None = None,
    calibration=None,
    temperature: float = 1.0,
    max_new_tokens: int = 64,
    seed: int = 0,
    warmup: bool = True,
    progress: bool = False,
    engine_kind: str = "plain",
    engine_kw: dict | None = None,
) -> dict[str, list[dict]]:
    """Run the engine per policy and concurrency; time its decode rounds.

    Prompts are repeated to fill at least R slots. Throughput = tokens emitted by decode rounds /
    their summed wall time (prefill is excluded: no policy changes it, and the analytical mode does
    not model it); tok/s/user = mean over requests of its tokens / the time of the rounds it was in
    (the tail, when fewer than R requests remain, counts: that is how a finite job behaves)."""
    from ..decoding.engine import Request
    from ..decoding.fast_engine import build_engine

    if not prompts:
        raise ReplayError("measured mode needs at least one prompt")
    first = next(iter(policies.values()))

    def engine(R: int, n_new: int):
        return build_engine(
            engine_kind,
            target,
            drafter,
            first,
            temperature=temperature,
            concurrency=R,
            max_new_tokens=n_new,
            calibration=calibration,
            cost=cost,
            seed=seed,
            **(engine_kw or {}),
        )

    if warmup:  # one-off costs (allocator growth, lazy kernels) stay out of the first point
        engine(1, 2).generate([list(prompts[0])])
    out: dict[str, list[dict]] = {name: [] for name in policies}
    bar = _bar(len(concurrency) * len(policies), "measure", progress)
    for R in concurrency:
        R = int(R)
        eng = None  # drop the previous R's caches (and graphs) before building this one's
        eng = engine(R, max_new_tokens)  # one engine serves every policy: a fast engine keeps its graphs
        n = max(len(prompts), R)
        reqs = [Request(prompt=list(prompts[i % len(prompts)]), id=i) for i in range(n)]
        for name, pol in policies.items():
            eng.set_policy(pol)
            eng.generator.manual_seed(seed)
            if hasattr(eng, "prepare"):
                eng.prepare(reqs)  # captures CUDA graphs before the timed run
            res = eng.generate(reqs)
            step_s = {s["step"]: s["ms"] * 1e-3 for s in res.steps}
            total_s = sum(step_s.values())
            toks: dict = {}
            secs: dict = {}
            for rec in res.rounds:
                toks[rec.request] = toks.get(rec.request, 0) + rec.emitted
                secs[rec.request] = secs.get(rec.request, 0.0) + step_s[rec.step]
            emitted = sum(toks.values())
            users = [toks[r] / secs[r] for r in toks if secs[r] > 0]
            rounds = max(len(res.rounds), 1)
            out[name].append(
                {
                    "concurrency": R,
                    "throughput": emitted / total_s if total_s > 0 else float("nan"),
                    "tps_per_user": float(np.mean(users)) if users else float("nan"),
                    "budget": sum(r.proposed for r in res.rounds) / rounds,
                    "tau": sum(r.accepted + 1 for r in res.rounds) / rounds,
                }
            )
            log.info("%s R=%d: %s", name, R, out[name][-1])
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    return out


def _verify_shape(B: int, gamma: int) -> tuple[int, int]:
    """Rows x tokens for a verification of ~B tokens: full blocks of γ+1 (anchor + γ drafts), the
    shape a block drafter verifies; the engine pads rows to the longest, so this is the shape it
    pays for. rows·tokens >= B by less than one row."""
    rows = max(1, -(-B // (gamma + 1)))
    return rows, -(-B // rows)


def profile_target(
    target, batch_sizes: Iterable[int], context_len: int, gamma: int, warmup: int = 2, repeats: int = 5
) -> dict[int, float]:
    """Step time (ms) of the target's verification forward over ``B`` tokens, each row attending
    to ``context_len`` cached positions (random K/V stand in for a prefill: the values do not
    change the work, only the time a prefill would take)."""
    from ..decoding.kv import RaggedKV
    from .cost import profile

    if context_len < 1:
        raise ValueError(f"context_len must be >= 1, got {context_len}")
    built: dict[int, tuple] = {}

    def step(B: int) -> None:
        if B not in built:
            built.clear()  # one shape alive at a time: large B caches are big
            rows, t = _verify_shape(B, gamma)
            kv = RaggedKV.empty(target.model.config, rows, context_len + t, target.dtype, target.device)
            for buf in kv.k + kv.v:  # not zeros: GPU power (and so clocks) depends on the data
                buf.normal_()
            kv.length.fill_(context_len)
            ids = torch.randint(0, target.vocab_size, (rows, t), device=target.device)
            pos = context_len + torch.arange(t, device=target.device).expand(rows, -1)
            built[B] = (kv, ids, pos)
        kv, ids, pos = built[B]
        mask = kv.plan(ids.shape[1], target.dtype)  # no commit: every repeat verifies the same slots
        target(ids, positions=pos, cache=kv, attention_mask=mask, use_cache=True)

    with torch.inference_mode():
        return profile(step, batch_sizes, warmup=max(1, warmup), repeats=repeats)


def profile_drafter(
    target,
    drafter,
    concurrency: Iterable[int],
    context_len: int,
    temperature: float = 1.0,
    warmup: int = 2,
    repeats: int = 5,
) -> dict[int, float]:
    """Step time (ms) of ``drafter.propose`` for R requests over ``context_len`` context positions."""
    from ..core.types import Shared
    from .cost import profile

    shared = Shared.of(target)
    device = target.device
    built: dict[int, tuple] = {}
    gen = torch.Generator().manual_seed(0)

    def step(R: int) -> None:
        if R not in built:
            built.clear()
            cache = drafter.new_cache(R, device)
            taps = torch.randn(R, context_len, target.tap_dim, device=device, dtype=target.dtype)
            pos = torch.arange(context_len, device=device).expand(R, -1)
            nxt = torch.randint(0, target.vocab_size, (R, context_len), device=device)
            valid = torch.ones(R, context_len, dtype=torch.bool, device=device)
            drafter.extend_context(cache, taps, pos, valid, nxt, shared)
            anchors = torch.randint(0, target.vocab_size, (R,), device=device)
            built[R] = (cache, anchors, torch.full((R,), context_len, device=device))
        cache, anchors, apos = built[R]
        drafter.propose(cache, anchors, apos, shared, temperature, gen)

    with torch.inference_mode():
        return profile(step, concurrency, warmup=max(1, warmup), repeats=repeats)


def _spikes(table: Mapping[int, float], tol: float) -> list[int]:
    """Batch sizes timed slower than some larger batch by more than ``tol``: a step cannot get
    cheaper with more tokens, so the smaller one was disturbed (preemption, GC, a cold cache)."""
    bs = sorted(table)
    return [b for i, b in enumerate(bs) if any(table[b] > (1 + tol) * table[c] for c in bs[i + 1 :])]


def _isotonic(bs: Sequence[int], ts: Sequence[float]) -> list[float]:
    """Least-squares non-decreasing fit (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for t in ts:
        blocks.append([t, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, n2), (m1, n1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in blocks for _ in range(int(n))]


def settle_profile(
    run, sizes: Sequence[int], tol: float = 0.05, retries: int = 2
) -> tuple[dict[int, float], dict]:
    """``run(sizes) -> {B: ms}``, re-timing the points that a larger batch undercuts (timing noise
    only ever adds time, so the smaller of two medians is kept); what still dips after ``retries``
    is smoothed by an isotonic fit. Returns the table and notes for the cost model's meta."""
    table = dict(run(list(sizes)))
    notes: dict = {}
    for _ in range(retries):
        bad = _spikes(table, tol)
        if not bad:
            return table, notes
        again = run(bad)
        notes.setdefault("retimed", []).extend(bad)
        table = {b: min(t, again.get(b, t)) for b, t in table.items()}
    if _spikes(table, tol):
        bs = sorted(table)
        notes["raw_ms"] = {str(b): table[b] for b in bs}
        table = dict(zip(bs, _isotonic(bs, [table[b] for b in bs])))
        log.warning(
            "profile still dips after %d re-timings; using an isotonic fit (raw times in meta)", retries
        )
    return table, notes


def _bar(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, dynamic_ncols=True)
