"""The measured frontier: the real engine per policy and concurrency, its decode rounds timed
(python -m dspark.schedule mode=measured, python -m dspark.bench.e2e). The analytical frontier,
from recorded rounds, is ``dspark.scheduling.replay``."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence

import numpy as np

from ..core.errors import ConfigError
from ..core.progress import progress_bar
from ..decoding.engine import LAUNCH_PARTS, Request
from ..decoding.fast_engine import build_engine
from ..scheduling.cost import CostModel
from ..scheduling.policies import Fixed, Policy, build_policy, position_counts, rows_bucket

log = logging.getLogger(__name__)

__all__ = ["check_policies", "compare", "goal_checks", "measure", "speedup_rows"]

WARMUP_TOKENS = 8  # per request of the untimed run before each timed one: a few rounds of each path


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
    waves: int = 1,
    warmup: bool = True,
    repeats: int = 1,
    progress: bool = False,
    engine_kind: str = "plain",
    engine_kw: dict | None = None,
    host_load_us: float = 0.0,
) -> dict[str, list[dict]]:
    """Run the engine per policy and concurrency; time its decode rounds.

    Prompts are repeated to fill at least ``waves`` · R requests: with ``waves`` > 1 a request that
    ends hands its slot to the next in the queue (continuous batching), so the rounds run at the
    load R until the queue runs dry and the final drain weighs about 1 / ``waves`` of the run.
    Throughput = tokens emitted by decode rounds / their summed wall time (prefill is excluded: no
    policy changes it, and the analytical mode does not model it); tok/s/user = mean over requests
    of its tokens / the time of the rounds it was in (the drain, when fewer than R requests remain,
    counts: that is how a finite job behaves).
    ``warmup``: one tiny run first, then before each timed run an untimed one of R requests of
    ``WARMUP_TOKENS`` with the same policy (the random stream is re-seeded after it).
    ``repeats``: timed runs per point, each from the same seed (a stateless policy replays the same
    rounds, so only their timing differs; an adaptive one starts each from what it learnt), taken in
    turns across the policies, each turn starting one policy later; the point is the run of median
    throughput and lists every run's speeds (``repeats``), so one run's one-off stall neither sets the
    point nor goes unseen.
    ``host_load_us``: a diagnostic load on the host (``load_host``), 0 for none."""
    if not prompts:
        raise ValueError("measured mode needs at least one prompt")
    if int(repeats) < 1 or int(waves) < 1:
        raise ValueError(f"repeats and waves must be >= 1, got {repeats} and {waves}")
    if not host_load_us >= 0:
        raise ValueError(f"host_load_us must be >= 0 µs, got {host_load_us}")
    first = next(iter(policies.values()))

    def engine(R: int, n_new: int):
        built = build_engine(
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
            record_confidence=False,  # the points need tokens and acceptance: no confidences read back
            **(engine_kw or {}),
        )
        return load_host(built, host_load_us)

    if warmup:  # one-off costs (allocator growth, lazy kernels) stay out of the first point
        engine(1, 2).generate([list(prompts[0])])
    out: dict[str, list[dict]] = {name: [] for name in policies}
    bar = progress_bar(len(concurrency) * len(policies) * int(repeats), "measure", progress)
    for R in concurrency:
        R = int(R)
        eng = None  # drop the previous R's caches (and graphs) before building this one's
        eng = engine(R, max_new_tokens)  # one engine serves every policy: a fast engine keeps its graphs
        n = max(len(prompts), int(waves) * R)
        reqs = [Request(prompt=list(prompts[i % len(prompts)]), id=i) for i in range(n)]
        runs: dict[str, list[dict]] = {name: [] for name in policies}
        # Repeats interleaved across the policies (each policy's run k after every policy's run
        # k - 1): a drift of the device's clocks over the minutes of a sweep lands on all alike. Run k
        # starts the turn at the k-th policy, so no policy always runs in the same place of it.
        names = list(policies)
        for k in range(int(repeats)):
            for name in names[k % len(names) :] + names[: k % len(names)]:
                pol = policies[name]
                eng.set_policy(pol)
                if k == 0 and hasattr(eng, "prepare"):
                    eng.prepare(reqs)  # sizes the caches for the timed run and captures its CUDA graphs
                if k == 0 and warmup:  # this policy's first-use costs at this R stay untimed
                    eng.generate([Request(prompt=r.prompt, max_new_tokens=WARMUP_TOKENS) for r in reqs[:R]])
                eng.generator.manual_seed(seed)  # the same seed each time: the same draws
                learner = pol if drafter is not None else None  # whose acceptance estimate to report
                runs[name].append(_point(R, eng.generate(reqs), eng.cost, learner))
                if bar is not None:
                    bar.update(1)
        for name in policies:
            out[name].append(_median_run(runs[name]))
            log.info("%s R=%d: %s", name, R, out[name][-1])
    if bar is not None:
        bar.close()
    return out


def load_host(engine, us: float):
    """A diagnostic: ``engine`` with every round's completion preceded by a busy wait of ``us`` µs
    (in the host's ``cycle_ms``, not in the round's ``host_ms``), which puts the host in the
    pace-setter's seat of runs it would otherwise keep ahead of. Whether the same launches then cost
    more (H100, T = 1, R = 256: the draft-aware schedulers' plain rounds, host-bound, launched
    1.5-1.6x slower than target-only's same code) says if being host-bound is itself the cost."""
    if us <= 0:
        return engine
    complete = engine._complete

    def loaded(rnd):
        until = time.perf_counter() + 1e-6 * us
        while time.perf_counter() < until:  # busy: a sleep would hand the core away
            pass
        return complete(rnd)

    engine._complete = loaded
    return engine


def _point(R: int, res, cost: CostModel | None = None, policy: Policy | None = None) -> dict:
    """One timed run's point: throughput, per-user speed, τ, verify budget, round means, the rounds
    by drafted length (``by_length``) and by what the round before was (``by_transition``), the
    acceptance per draft position the rounds realised (``acceptance``) and, for a policy that keeps
    one, its estimate of it after the run (``acceptance_estimate``): what a scheduler's choices are
    judged against; for a walking policy its reasons to walk after the run (``walk_state``)."""
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
    return {
        "concurrency": R,
        "throughput": emitted / total_s if total_s > 0 else float("nan"),
        "tps_per_user": float(np.mean(users)) if users else float("nan"),
        "budget": sum(r.proposed for r in res.rounds) / rounds,
        "tau": sum(r.accepted + 1 for r in res.rounds) / rounds,
        "tau_se": tau_standard_error(res.rounds),
        **_round_means(res.steps),
        "at_load": _at_load(res.steps, R),
        "by_length": _by_length(res.steps, cost),
        "by_transition": rounds_by_transition(res.steps),
        "acceptance": _realised_acceptance(res.rounds),
        "acceptance_estimate": _estimate(policy, res.rounds),
        "walk_state": _walk_state(policy),
        "plans": _plans(res.steps),
    }


def tau_standard_error(rounds) -> float | None:
    """The standard error of the run's τ (Σ (accepted + 1) / rounds) over its requests, the
    sampling unit: a request's rounds share one text, so they are not independent draws. The
    ratio estimator's linearised error; None with fewer than two requests."""
    num: dict = {}
    den: dict = {}
    for r in rounds:
        num[r.request] = num.get(r.request, 0) + r.accepted + 1
        den[r.request] = den.get(r.request, 0) + 1
    n = len(num)
    if n < 2:
        return None
    tokens, counts = np.array([num[k] for k in num], float), np.array([den[k] for k in num], float)
    tau = tokens.sum() / counts.sum()
    residual = tokens - tau * counts
    return float(np.sqrt(n / (n - 1) * np.sum(residual**2)) / counts.sum())


def _at_load(steps: list[dict], R: int) -> dict:
    """The run's speeds at the load R: over the rounds whose live rows fill R's bucket (the rounds
    that run R's graphs: with ``waves`` > 1 every round until the queue runs dry), leaving out the
    drain, where fewer rows than R's bucket remain and a round serves a smaller load. ``throughput``:
    their tokens / their time; ``tps_per_user``: their tokens / the time the live rows spent in them
    (each row of a round spends the round), the users' mean speed weighted by time; ``share``: their
    part of the run's round time. The points to compare at a load, as a server holding R requests
    at once sees them (§5.3: then throughput and speed per user move together)."""
    bucket = rows_bucket(R)
    timed = [s for s in steps if s.get("ms") is not None and s.get("batch")]
    full = [s for s in timed if rows_bucket(s["batch"]) == bucket]
    ms = sum(s["ms"] for s in full)
    if not full or ms <= 0:
        return {"rounds": 0, "share": 0.0, "throughput": None, "tps_per_user": None}
    tokens = sum(s["tokens"] for s in full)
    return {
        "rounds": len(full),
        "share": ms / sum(s["ms"] for s in timed),
        "throughput": 1e3 * tokens / ms,
        "tps_per_user": 1e3 * tokens / sum(s["ms"] * s["batch"] for s in full),
    }


def _by_length(steps: list[dict], cost: CostModel | None) -> list[dict]:
    """Per rows bucket and drafted length (0: plain rounds), largest bucket first: the rounds, their
    mean time and the host's own work in them (``host_ms``: above ``ms`` the host set the pace;
    ``launch_ms`` and ``policy_ms`` of it putting the round on the device and the policy's calls;
    ``launch_parts`` the launch by part, ``engine.LAUNCH_PARTS``: where a length's launch differs), the
    tokens they emitted and the positions they verified per live row (the anchor included: below
    1 + drafted where a walk cut the draft), how many of them walked (``walked``: read their width
    back), and the cost table's price of them as the engine prices them (``priced_ms``, the whole
    draft verified; None without a table). Measured against priced, rate against rate, it shows where
    a scheduler's model of the rounds was wrong."""
    groups: dict[tuple[int, int], np.ndarray] = {}
    for s in steps:
        if s.get("ms") is None or not s.get("batch"):
            continue
        priced = 1e3 * cost.round_times(s["batch"], s["drafted"])[s["drafted"]] if cost is not None else 0.0
        parts = s.get("launch_parts") or {}  # steps recorded without them count 0
        g = groups.setdefault((rows_bucket(s["batch"]), int(s["drafted"])), np.zeros(10 + len(LAUNCH_PARTS)))
        g += (1, s["ms"], s.get("host_ms") or 0.0, s.get("launch_ms") or 0.0, s.get("policy_ms") or 0.0,
              s["tokens"], s["verified"], s["batch"], priced, (s.get("readback_ms") or 0.0) > 0,
              *(parts.get(p, 0.0) for p in LAUNCH_PARTS))  # fmt: skip
    return [
        {"rows_bucket": b, "drafted": d, "rounds": int(n), "ms": ms / n, "host_ms": host / n,
         "launch_ms": launch / n, "policy_ms": policy / n, "tokens_per_row": tokens / rows,
         "verified_per_row": verified / rows, "priced_ms": priced / n if cost is not None else None,
         "walked": int(walked), "launch_parts": {p: float(v / n) for p, v in zip(LAUNCH_PARTS, parts)}}
        for (b, d), (n, ms, host, launch, policy, tokens, verified, rows, priced, walked, *parts) in sorted(
            groups.items(), key=lambda g: (-g[0][0], g[0][1]))
    ]  # fmt: skip


def rounds_by_transition(*runs: list[dict]) -> list[dict]:
    """Over the runs' steps (each run's own sequence), per rows bucket, drafted length, the kind of
    the round before (``after``: plain or drafting) and whether it had as many live rows as the
    round before (``rows``: same or changed: a request ended and its row idles, or rows left and
    joined): the rounds and their mean and median time. For every policy, so one kind of round can
    be set beside the same kind under another policy like for like: a drafting round right after a
    plain one writes the plain rounds' deferred context first, and a round after a request ended
    carries its idle row (``bench.plans``). A run's first round, with none before it, is left out."""
    groups: dict[tuple[int, int, bool, bool], list[float]] = {}
    for steps in runs:
        for prev, s in zip(steps, steps[1:]):
            if s.get("ms") is None or not s.get("batch") or not prev.get("batch"):
                continue
            same_rows = s["batch"] == prev["batch"]
            key = (rows_bucket(s["batch"]), int(s["drafted"]), prev["drafted"] == 0, same_rows)
            groups.setdefault(key, []).append(s["ms"])
    return [
        {"rows_bucket": b, "drafted": d, "after": "plain" if plain else "drafting",
         "rows": "same" if same else "changed", "rounds": len(ms), "ms": float(np.mean(ms)),
         "median_ms": float(np.median(ms))}
        for (b, d, plain, same), ms in sorted(groups.items(), key=lambda g: (-g[0][0], *g[0][1:]))
    ]  # fmt: skip


# ``_plans``' entries that hold a value per round
PLAN_ROUNDS = (
    "step", "rows", "drafted", "walked", "ms", "tokens", "expected_tokens", "expected_ms", "over_plain",
    "clock_ratio",
)  # fmt: skip


def _plans(steps: list[dict]) -> dict | None:
    """Round by round, under a policy that weighs drafted lengths (its records' ``plan``), what it
    chose and on what grounds, to find where a load-aware scheduler drafts or declines: each
    round's step, live rows, drafted length, whether it walked (read its width back), ``ms`` and
    the tokens it emitted; what the plan expected of the length it chose: its tokens and its time
    (the table's price times the clock's ratio), so a run tells how far the estimates were off by
    length; each length's expected rate as a multiple of a plain round's (``over_plain``) and the
    rounds' clock's measured / priced ratio it was priced with (``clock_ratio``). Summed up: the plain
    rounds, how many of them declined a draft expected to be faster (by less than the policy's
    margin) and the best draft's expected rate over plain in them (median, max); the drafting
    rounds, their chosen length's (median) and how many drafted below plain's expected rate (the
    probes of a plain streak, the clock's explorations). None for other policies."""
    planned = [s for s in steps if s.get("plan") is not None]
    if not planned:
        return None
    plans = [s["plan"] for s in planned]
    over = [[round(r / rates[0], 3) for r in rates] for rates, _, _ in plans]
    drafted = [int(s["drafted"]) for s in planned]
    best_draft = [max(o[1:], default=0.0) for o, d in zip(over, drafted) if d == 0]
    chosen = [o[d] for o, d in zip(over, drafted) if d > 0]

    def quantile(values, q):
        return float(np.quantile(values, q)) if values else None

    return {
        "plain_rounds": len(best_draft),
        "plain_declined_faster": sum(b > 1.0 for b in best_draft),
        "plain_best_draft_median": quantile(best_draft, 0.5),
        "plain_best_draft_max": quantile(best_draft, 1.0),
        "drafting_rounds": len(chosen),
        "drafting_chosen_median": quantile(chosen, 0.5),
        "drafting_below_plain": sum(c < 1.0 for c in chosen),
        "step": [s["step"] for s in planned],
        "rows": [s["batch"] for s in planned],
        "drafted": drafted,
        "walked": [int((s.get("readback_ms") or 0.0) > 0) for s in planned],
        "ms": [None if s.get("ms") is None else round(s["ms"], 3) for s in planned],
        "tokens": [int(s["tokens"]) for s in planned],
        "expected_tokens": [round(tokens[d], 2) for (_, _, tokens), d in zip(plans, drafted)],
        "expected_ms": [
            round(1e3 * tokens[d] / rates[d], 3) if rates[d] > 0 else None
            for (rates, _, tokens), d in zip(plans, drafted)
        ],
        "over_plain": over,
        "clock_ratio": [[round(r, 3) for r in ratios] for _, ratios, _ in plans],
    }


def _realised_acceptance(rounds) -> list[float | None]:
    """Per draft position: the share of the rows that reached it which accepted it (None where
    no row did); empty for target-only."""
    lengths = np.array([r.proposed for r in rounds], dtype=np.int64)
    n = int(lengths.max(initial=0))
    hits, tries = position_counts(lengths, np.array([r.accepted for r in rounds], dtype=np.int64), n)
    return [float(h / t) if t else None for h, t in zip(hits, tries)]


def _estimate(policy: Policy | None, rounds) -> list[float] | None:
    """A policy's estimate of the acceptance per drafted position (``DraftAware``,
    ``HardwareAware``), over the longest draft the run verified; None for the others."""
    acceptance = getattr(policy.base, "acceptance", None) if policy is not None else None
    n = max((r.proposed for r in rounds), default=0)
    return None if acceptance is None or n == 0 else [float(c) for c in acceptance(n)]


def _walk_state(policy: Policy | None) -> dict | None:
    """After the run, a walking policy's reasons to walk (``HardwareAware.walk_state``); None for
    the others."""
    state = getattr(policy.base, "walk_state", None) if policy is not None else None
    return None if state is None else state()


def _median_run(runs: list[dict]) -> dict:
    """The run of median throughput (the lower middle of an even count), with every run's speeds,
    slowest round (its record and the one-off work around it: where a stalled run lost its time)
    and ``plans`` (a load-aware policy's runs differ most: each starts from what the last learnt);
    the median's own ``plans`` keeps its sums, its rounds being in ``repeats``."""
    if len(runs) == 1:
        return runs[0]
    order = sorted(range(len(runs)), key=lambda i: runs[i]["throughput"])
    keys = ("throughput", "tps_per_user", "max_ms_round", "slowest_round", "plans")
    median = runs[order[(len(runs) - 1) // 2]]
    plans = median["plans"] and {k: v for k, v in median["plans"].items() if k not in PLAN_ROUNDS}
    return {**median, "plans": plans, "repeats": [{k: r[k] for k in keys} for r in runs]}


def _round_means(steps: list[dict]) -> dict:
    """Per engine round: its time on the device's timeline (``ms``; its median and the slowest
    round too, so a one-off stall shows), the host's own work (``host_ms``, hidden behind the
    device when it is shorter; of it ``launch_ms`` putting the round on the device, by part in
    ``launch_parts``, the rest reading its outcome, and ``policy_ms`` the scheduling policy's calls
    in both), the host's waits for the round's outcome (``wait_ms``) and for a read-back of its
    verify width (``readback_ms``: a bubble on the device), the host's clock from one round's
    completion to the next (``cycle_ms``: where ``cycle_ms - wait_ms`` reaches ``ms``, the host sets
    the pace) and of it the work outside launching and completing rounds (``between_ms``: requests
    leaving and joining, the joiners' prefill), the device's work
    (``gpu_ms``, CUDA only), the device's idle time before the round (``gap_ms = ms - gpu_ms``:
    the host late, or device work between rounds such as row moves) and the positions drafted
    (``drafted``: 0 in a plain decoding round); ``slowest_round`` is that round's record;
    ``events`` the run's one-off work (``decoding.stall_watch``), which a warmed run keeps at 0."""

    def values(key):
        return [s[key] for s in steps if s.get(key) is not None]

    def mean(key):
        v = values(key)
        return float(np.mean(v)) if v else None

    ms = values("ms")
    keys = (
        "ms", "host_ms", "launch_ms", "policy_ms", "wait_ms", "readback_ms", "cycle_ms", "between_ms",
        "gpu_ms", "drafted",
    )  # fmt: skip
    gaps = [s["ms"] - s["gpu_ms"] for s in steps if s.get("gpu_ms") is not None]
    parts = values("launch_parts")
    part_means = {p: float(np.mean([x[p] for x in parts])) for p in LAUNCH_PARTS} if parts else None
    return {
        "rounds": len(steps),
        **{f"{k}_per_round": mean(k) for k in keys},
        "launch_parts_per_round": part_means,
        "gap_ms_per_round": float(np.mean(gaps)) if gaps else None,
        "median_ms_per_round": float(np.median(ms)) if ms else None,
        "max_ms_round": float(max(ms)) if ms else None,
        "slowest_round": _slowest(steps),
        "events": _events_sum(steps),
    }


def _events_sum(steps: list[dict]) -> dict:
    """The run's one-off work (graph captures, compiles, GC passes), summed over its rounds."""
    total: dict = {}
    for s in steps:
        for key, value in s.get("events", {}).items():
            if key == "triton_kernels":
                kernels = total.setdefault(key, {})
                for name, n in value.items():
                    kernels[name] = kernels.get(name, 0) + n
            else:
                total[key] = total.get(key, 0) + value
    return total


def _slowest(steps: list[dict]) -> dict | None:
    """The slowest round's own record (its place in the run, batch, drafted and verified counts,
    device, host, wait and read-back times): where a one-off stall sat, and on which side."""
    timed = [s for s in steps if s.get("ms") is not None]
    if not timed:
        return None
    i = max(range(len(timed)), key=lambda j: timed[j]["ms"])
    keys = ("step", "batch", "drafted", "verified", "ms", "gpu_ms", "host_ms", "launch_ms", "policy_ms",
            "wait_ms", "readback_ms", "launch_parts")  # fmt: skip
    # A stall between rounds shows in the next round's span, while its work is counted in the
    # record of the round completed around it: the neighbours' events are the suspects too.
    near = {f"{j - i:+d}": timed[j]["events"] for j in range(max(i - 2, 0), min(i + 2, len(timed)))
            if timed[j].get("events")}  # fmt: skip
    return {"index": i, "of": len(timed), **{k: timed[i].get(k) for k in keys}, "events_near": near}


def speedup_rows(base: list[dict], runs: dict[str, list[dict]], label: str) -> list[dict]:
    """Per concurrency: the target-only point, then each policy's (``<label>/<policy>``) with its
    speed-up over target-only at the same R, per user and in aggregate, over the whole run and at
    the load R (``_at_load``; None where either point has no round at it)."""
    rows = []
    for i, b in enumerate(base):
        rows.append({"run": "target_only", **b})
        for name, points in runs.items():
            p = points[i]
            rows.append({"run": f"{label}/{name}", **p, **_speedups(p, b)})
    return rows


def _speedups(point: dict, base: dict) -> dict:
    out = {}
    for axis in ("per_user", "throughput"):
        key = "tps_per_user" if axis == "per_user" else "throughput"
        out[f"speedup_{axis}"] = point[key] / base[key]
        mine, theirs = (point.get("at_load") or {}).get(key), (base.get("at_load") or {}).get(key)
        out[f"speedup_{axis}_at_load"] = mine / theirs if mine and theirs else None
    return out


def goal_checks(rows: list[dict], floor: float = 0.98) -> list[dict]:
    """Per concurrency, from ``speedup_rows``: the best policy per user, in aggregate, and on both
    at once against target-only (the issue's floor: one policy >= ``floor`` x on both), and whether
    ``hardware_aware`` matches or beats every fixed-length policy (``fixed``, ``fixed_<g>``,
    ``mtp1``) in both: ``hardware_aware_vs_fixed`` its worst ratio over them and both axes, and
    ``hardware_aware_verdict`` "beats" (>= 1), "ties" (short by less than ``run_noise``, how
    far the compared points' own timed repeats stray, or at T > 0 by less than twice
    ``tau_noise``) or "loses". Judged over the whole runs, and
    the same at the load R under ``at_load`` (None where a point has no round at it)."""
    out = []
    for R in sorted({r["concurrency"] for r in rows}):
        runs = {
            r["run"].split("/")[-1]: r for r in rows if r["concurrency"] == R and r["run"] != "target_only"
        }
        if not runs:
            continue
        check = {"concurrency": R, **_judge(runs, "", floor)}
        loaded = all(r.get("speedup_per_user_at_load") and r.get("speedup_throughput_at_load")
                     for r in runs.values())  # fmt: skip
        check["at_load"] = _judge(runs, "_at_load", floor) if loaded else None
        out.append(check)
    return out


def _judge(runs: dict[str, dict], at: str, floor: float) -> dict:
    """``goal_checks``' verdicts on one pair of speed-ups (``at``: "" the whole run, "_at_load")."""

    def speed(run: dict, key: str) -> float:  # a point's own speed, whole run or at load
        return run[key] if not at else run["at_load"][key]

    user_of = {n: r[f"speedup_per_user{at}"] for n, r in runs.items()}
    agg_of = {n: r[f"speedup_throughput{at}"] for n, r in runs.items()}
    worse = {n: min(user_of[n], agg_of[n]) for n in runs}  # the weaker axis
    user, agg, both = (max(d, key=d.get) for d in (user_of, agg_of, worse))
    check = {
        "best_per_user": user,
        "best_speedup_per_user": user_of[user],
        "best_throughput": agg,
        "best_speedup_throughput": agg_of[agg],
        "best_on_both": both,
        "best_on_both_speedup": worse[both],
        "floor_met": worse[both] >= floor,  # one policy at >= floor x per user and in aggregate
    }
    fixed = [n for n in runs if n == "fixed" or n == "mtp1" or n.startswith("fixed_")]
    if "hardware_aware" in runs and fixed:
        ha = runs["hardware_aware"]
        keys = ("tps_per_user", "throughput")
        ratio, worst = min((speed(ha, k) / speed(runs[n], k), n) for n in fixed for k in keys)
        check["hardware_aware_beats_fixed"] = ratio >= 1
        noise = max(run_noise(runs[n]) for n in ["hardware_aware", *fixed])
        sampled = tau_noise(ha, runs[worst])  # of the pair that sets the ratio
        check["hardware_aware_vs_fixed"] = ratio
        check["run_noise"] = noise
        check["tau_noise"] = sampled
        tie = max(noise, 2 * sampled)
        check["hardware_aware_verdict"] = "beats" if ratio >= 1 else "ties" if ratio >= 1 - tie else "loses"
    return check


def run_noise(point: dict) -> float:
    """How far a point's timed repeats stray from their median: the median absolute deviation
    over the median (one stalled repeat does not widen it), the larger of per-user speed and
    throughput; 0 without repeats."""
    reps = point.get("repeats") or []
    if len(reps) < 2:
        return 0.0
    spreads = []
    for key in ("tps_per_user", "throughput"):
        values = np.array([r[key] for r in reps], dtype=float)
        median = np.median(values)
        spreads.append(float(np.median(np.abs(values - median)) / median))
    return max(spreads)


def tau_noise(a: dict, b: dict) -> float:
    """The relative standard error of τ_a / τ_b for two points of one comparison. At T > 0 each
    policy's runs sample texts of their own, so their τ differ by chance (the H200, T = 1, 32 gsm8k
    prompts: fixed γ = 7 alone realised τ 2.26-2.38 over four R, session -f); at T = 0 every
    lossless policy emits the same greedy text and the comparison is paired: 0. Also 0 where a
    point has no ``tau_se``."""
    if not (a.get("temperature") or b.get("temperature")):
        return 0.0
    shares = [p["tau_se"] / p["tau"] if p.get("tau_se") and p.get("tau") else 0.0 for p in (a, b)]
    return float(np.hypot(*shares))


def check_policies(names: Sequence[str], cost: CostModel | None) -> None:
    """The policy names of a comparison, before any model loads."""
    if not names:
        raise ConfigError("--policies is empty: e.g. fixed,mtp1,threshold,hardware_aware,draft_aware")
    needy = [n for n in names if build_policy(n).needs_cost and cost is None]
    if needy:
        raise ConfigError(
            f"policies {needy} need a cost table: pass --cost-table <the json written by "
            "python -m dspark.bench.engine_sps --drafter-dir ... --cost-table ...>"
        )


def compare(
    target, drafter, names: Sequence[str], concurrency: Sequence[int], prompts, temperatures: Sequence[float],
    *, cost: CostModel | None, calibration=None, **common,
) -> tuple[list[dict], dict[str, list[dict]]]:  # fmt: skip
    """Target-only against the drafter under each named policy, per temperature and concurrency:
    the rows of ``speedup_rows`` (each with its ``temperature``) and ``goal_checks`` per
    temperature. Policies are built afresh per temperature, so stateful ones start clean."""
    rows, goals = [], {}
    gamma = int(drafter.gamma)
    for temperature in temperatures:
        policies = {n: build_policy(n, gamma=gamma, defaults={"check": False}) for n in names}
        base = measure(target, None, {"target_only": Fixed(None)}, concurrency, prompts, cost=cost,
                       temperature=temperature, **common)["target_only"]  # fmt: skip
        spec = measure(target, drafter, policies, concurrency, prompts, cost=cost, calibration=calibration,
                       temperature=temperature, **common)  # fmt: skip
        these = [{"temperature": temperature, **row} for row in speedup_rows(base, spec, drafter.kind)]
        rows += these
        goals[f"{temperature:g}"] = goal_checks(these)
    return rows, goals
