"""End-to-end decoding speed in one engine: target-only vs speculative decoding with a drafter.

    python -m dspark.bench.e2e --drafter-dir <checkpoint> target=smollm2_135m target.device=cuda \\
        [--engine fast] [--benchmark gsm8k] [--benchmark-dir <folder>] [--prompts 32] \\
        [--concurrency 1,64,256] [--waves 1] [--max-new-tokens 128] [--temperature 0[,1]] \\
        [--policies fixed,mtp1,threshold,hardware_aware,draft_aware --cost-table cost_table.json] \\
        [--repeats 3] [--no-compile] [--draft-vocab K] [--out e2e.json]

For each temperature and concurrency R the same prompts (repeated to fill R slots; ``--waves`` k queues
k · R requests behind them, continuous batching: a request that ends hands its slot on) run target-only
and with the drafter under each policy (a name with ``:argument=value`` pairs, e.g.
``draft_aware:probe_every=128``, runs that variant beside the others), each timed run after an untimed
warm-up of R short requests, ``--repeats`` times from the same seed (in turns across the policies, each
turn starting one policy later, so a drift of the device lands on all alike): the run of median
throughput is the point, every run's speeds are listed with it, so one run's one-off stall neither sets
nor hides in the numbers. Reported per point, from the engine's own round timings (prefill excluded, as
in ``python -m dspark.schedule mode=measured``): aggregate tokens/s, mean tokens/s per user, τ, the mean
round's time on the device's timeline (and its median and slowest round, with the one-off work counted
around it: graph captures, compiles, GC passes), the device's work, the host's own work, its waits for a
read-back of the verify width, the host's cycle from one round's completion to the next and of it the
work between rounds (requests leaving and joining), the device's idle gap before the round, and the
drafted positions; the drafter's speed-up over target-only at the same R, over the whole run and at the
load R (``at_load``: the rounds that ran with R's rows, the drain left out: the speeds a server holding
R requests sees); and per R, both ways, the best policy against target-only and whether hardware_aware
beats every fixed length (``goals``). Each point also keeps its rounds by rows bucket and drafted
length, measured against the cost table's price (``by_length``), and by what the round before was
(``by_transition``: a switch between plain and drafting rounds, a row that ended), the acceptance per
draft position the rounds realised and the scheduler's estimate of it: where a choice went wrong. The
fast engine compiles the target and the drafter on CUDA unless ``--no-compile``. ``--draft-vocab K``:
the drafter drafts among its K most frequent training-answer tokens (``decoding.draft_vocab``). ``python -m
dspark.schedule mode=e2e e2e=<this json>`` draws the measured frontier from it.
"""

from __future__ import annotations

import argparse
import logging

from ..data.benchmarks import PACKAGED_BENCHMARKS
from .common import add_draft_vocab_args

log = logging.getLogger(__name__)


def _parse(argv):
    ap = argparse.ArgumentParser(prog="python -m dspark.bench.e2e", description=__doc__.split("\n")[0])
    ap.add_argument("--drafter-dir", required=True)
    add_draft_vocab_args(ap)
    ap.add_argument("--engine", default="fast", choices=["plain", "fast"])
    ap.add_argument("--benchmark", default="gsm8k")
    ap.add_argument("--benchmark-dir", default=PACKAGED_BENCHMARKS, help="default: the suites dspark ships")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--concurrency", default="1,64,256")
    ap.add_argument(
        "--waves", type=int, default=1,
        help="requests per slot: each R runs max(prompts, waves·R) requests; 1 (the default) is one "
        "batch, whose drain (its last rows finishing alone) the whole-run speeds include and the "
        "at-load ones leave out; more keep the load at R longer, each finished request's slot "
        "refilled by a prefill of its own, behind the round in flight",
    )  # fmt: skip
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", default="0", help="one or more, comma-separated")
    ap.add_argument(
        "--policies", default="fixed", help="comma list of policy names; name:argument=value runs a variant"
    )
    ap.add_argument("--cost-table", default=None, help="needed by hardware_aware / async_topk")
    ap.add_argument("--drafter-dtype", default="target", choices=["target", "float32"])
    ap.add_argument(
        "--compile", action=argparse.BooleanOptionalAction, default=None,
        help="torch.compile the fast engine's target and drafter layers (default: on CUDA)",
    )  # fmt: skip
    ap.add_argument(
        "--repeats", type=int, default=3,
        help="timed runs per point, same seed; the run of median throughput is reported (all listed)",
    )  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--pipeline", type=int, default=1, choices=[1, 2],
        help="rounds launched ahead of the one the host reads (the engine's pipeline): 2 keeps a round "
        "queued on the device while the host reads one",
    )  # fmt: skip
    ap.add_argument(
        "--host-load-us", type=float, default=0.0,
        help="diagnostic: a busy wait of this many µs before each round's completion, every run alike, "
        "so the host sets the pace (do launches cost more then?); 0, the default, for none",
    )  # fmt: skip
    ap.add_argument("--out", default="e2e.json")
    return ap.parse_known_args(argv)


def main(argv=None) -> dict:
    from ..core.compiling import RecompileLimitWatch

    with RecompileLimitWatch() as watch:  # its hits go into the report (compile_fallbacks)
        return _main(argv, watch)


def _main(argv, watch) -> dict:
    import sys

    from ..artifacts import DrafterFolder
    from ..checkpoints import load_drafter
    from ..core.errors import ConfigError
    from ..core.io import atomic_write_json
    from ..data.benchmarks import first_turns
    from ..decoding.engine import LAUNCH_PARTS
    from ..scheduling.cost import CostModel
    from ..target import load_target
    from .common import (
        compose_target,
        kernel_fallbacks,
        publish,
        report_header,
        say_compile_fallbacks,
        served_draft_vocab,
    )
    from .measure import check_policies, compare, goal_checks

    argv = sys.argv[1:] if argv is None else argv
    args, overrides = _parse(argv)
    target_cfg = compose_target(overrides)
    temperatures = _temperatures(args.temperature)
    if args.repeats < 1:
        raise ConfigError(f"--repeats {args.repeats}: give at least 1 timed run per point (default 3)")
    if args.waves < 1:
        raise ConfigError(f"--waves {args.waves}: give at least 1 request per slot (default 1)")
    if not args.host_load_us >= 0:
        raise ConfigError(f"--host-load-us {args.host_load_us}: give a busy wait of >= 0 µs (0: none)")
    texts = first_turns(args.benchmark, args.benchmark_dir, args.prompts)  # fails fast on a bad name
    cost = CostModel.load(args.cost_table) if args.cost_table else None
    priced = None if cost is None else cost.meta.get("temperature")  # engine_sps --temperature
    if priced is not None and any(float(priced) != t for t in temperatures):
        log.warning(
            "the cost table was measured at T = %g and prices runs at T = %s: greedy rounds (T = 0) cost "
            "less than sampled ones; give each temperature its own table (engine_sps --temperature)",
            float(priced), args.temperature,
        )  # fmt: skip
    names = [p for p in args.policies.split(",") if p]
    check_policies(names, cost)
    target = load_target(target_cfg)
    drafter, _ = load_drafter(args.drafter_dir, target, device=target.device)
    if args.drafter_dtype == "target":  # serve the drafter in the target's precision
        drafter = drafter.to(target.dtype)
    calibration = DrafterFolder(args.drafter_dir).read_calibration()
    vocab, vocab_report = served_draft_vocab(args, target)
    mismatch = None if cost is None else cost.draft_vocab_mismatch(vocab_report)
    if mismatch:
        log.warning(mismatch)
    prompts = [target.prompt_ids(t) for t in texts]
    gamma = int(drafter.gamma)
    conc = [int(r) for r in args.concurrency.split(",")]
    report = {
        **report_header("dspark.bench.e2e", argv, target, args.compile),
        "compile_fallbacks": watch.hits,  # functions dynamo gave up compiling: their shapes ran eagerly
        "drafter": str(args.drafter_dir),
        "drafter_dtype": str(next(drafter.parameters()).dtype).replace("torch.", ""),
        "draft_vocab": vocab_report,  # None: the whole vocabulary
        "engine": args.engine,
        "benchmark": args.benchmark,
        "prompts": len(prompts),
        "temperature": temperatures[0] if len(temperatures) == 1 else temperatures,
        "max_new_tokens": args.max_new_tokens,
        "waves": args.waves,
        "repeats": args.repeats,
        "pipeline": args.pipeline,
        "host_load_us": args.host_load_us,
        "gamma": gamma,
        "cost_table": None if cost is None else cost.to_dict(),
        "rows": [],
        "goals": {},
    }
    # One concurrency at a time, the report rewritten after each: a run cut off by a time limit keeps
    # every point it finished (policies start afresh at each R, so each point stands alone).
    engine_kw = {"pipeline": args.pipeline, "draft_vocab": vocab}
    if args.engine == "fast":
        engine_kw["compile"] = args.compile
    for temperature in temperatures:
        these = []
        for R in conc:
            rows, _ = compare(
                target, drafter, names, [R], prompts, [temperature], cost=cost, calibration=calibration,
                max_new_tokens=args.max_new_tokens, seed=args.seed, repeats=args.repeats, waves=args.waves,
                engine_kind=args.engine, engine_kw=engine_kw, host_load_us=args.host_load_us,
            )  # fmt: skip
            these += rows
            report["rows"] += rows
            report["goals"][f"{temperature:g}"] = goal_checks(these)
            atomic_write_json(args.out, report)
    rows, goals = report["rows"], report["goals"]
    kernel_fallbacks(report)
    publish(
        args.out,
        report,
        ["T", "run", "R", "tok/s/user", "aggregate tok/s", "τ", "speed-up/user", "speed-up aggregate",
         "drafted", "round ms", "median ms", "max ms", "gpu ms", "host ms", "launch ms", "policy ms",
         "read-back ms", "cycle ms", "between ms", "gap ms"],
        [
            [f"{row['temperature']:g}", row["run"], f"{row['concurrency']}", f"{row['tps_per_user']:.1f}",
             f"{row['throughput']:.0f}", _tau(row), f"{row.get('speedup_per_user', 1.0):.2f}x",
             f"{row.get('speedup_throughput', 1.0):.2f}x", f"{row.get('drafted_per_round') or 0:.2f}",
             *(f"{_num(row, k):.2f}" for k in ("ms_per_round", "median_ms_per_round", "max_ms_round",
                                                "gpu_ms_per_round", "host_ms_per_round",
                                                "launch_ms_per_round", "policy_ms_per_round",
                                                "readback_ms_per_round", "cycle_ms_per_round",
                                                "between_ms_per_round", "gap_ms_per_round"))]
            for row in rows
        ],
    )  # fmt: skip
    _print_by_length(
        rows,
        "rounds by rows bucket and drafted length: count (walked), measured/priced/host/launch/policy ms, "
        "tokens/verified a row",
        lambda g: (
            f"{g['rounds']} ({g['walked']}), {g['ms']:.2f}/{_num(g, 'priced_ms'):.2f}/{g['host_ms']:.2f}/"
            f"{g['launch_ms']:.2f}/{g['policy_ms']:.2f}, "
            f"{g['tokens_per_row']:.2f}/{g['verified_per_row']:.2f}"
        ),
    )
    _print_by_length(
        rows,
        f"the launch by part, ms a round ({'/'.join(LAUNCH_PARTS)})",
        lambda g: "/".join(f"{g['launch_parts'][p]:.3f}" for p in LAUNCH_PARTS),
    )
    _print_plans(rows)
    for temperature, checks in goals.items():
        for c in checks:
            print(f"T={temperature} R={c['concurrency']}: {_goals_line(c)}")
            if c.get("at_load"):  # the least of the points' shares of round time at the load R
                here = [r for r in rows if r["concurrency"] == c["concurrency"]]
                share = min(r["at_load"]["share"] for r in here if f"{r['temperature']:g}" == temperature)
                print(f"    at the load R (>= {100 * share:.0f} % of each run): {_goals_line(c['at_load'])}")
    say_compile_fallbacks(watch.hits)
    return report


def _print_by_length(rows: list[dict], title: str, cell) -> None:
    """A line per point: ``cell`` of each of its rows buckets and drafted lengths (``by_length``)."""
    print(f"\n{title}")
    for row in rows:
        cells = [f"b{g['rows_bucket']} γ{g['drafted']}: {cell(g)}" for g in row.get("by_length", [])]
        print(f"T={row['temperature']:g} R={row['concurrency']} {row['run']}: " + "; ".join(cells))


def _print_plans(rows: list[dict]) -> None:
    """A line per point of a policy that weighs drafted lengths: its plain rounds and the drafts
    they declined, its drafting rounds (``measure._plans``; round by round in the JSON)."""
    planned = [r for r in rows if r.get("plans")]
    if planned:
        print(
            "\nplans: plain rounds (declining a draft expected faster; the best draft's expected rate "
            "over plain, median / max), drafting rounds (the chosen length's, median; below plain's: probes "
            "and explorations)"
        )
    for row in planned:
        p = row["plans"]
        print(
            f"T={row['temperature']:g} R={row['concurrency']} {row['run']}: plain {p['plain_rounds']} "
            f"({p['plain_declined_faster']}; {_num(p, 'plain_best_draft_median'):.3f} / "
            f"{_num(p, 'plain_best_draft_max'):.3f}), drafting {p['drafting_rounds']} "
            f"({_num(p, 'drafting_chosen_median'):.3f}; {p['drafting_below_plain']})"
        )


def _goals_line(c: dict) -> str:
    return (
        f"best per user {c['best_per_user']} {c['best_speedup_per_user']:.2f}x, best aggregate "
        f"{c['best_throughput']} {c['best_speedup_throughput']:.2f}x, best on both {c['best_on_both']} "
        f"{c['best_on_both_speedup']:.2f}x (>= 0.98x: {c['floor_met']}), hardware_aware vs every fixed: "
        f"{_verdict(c)}"
    )


def _verdict(check: dict) -> str:
    if "hardware_aware_verdict" not in check:
        return "n/a"
    return (
        f"{check['hardware_aware_verdict']} ({check['hardware_aware_vs_fixed']:.3f}x, "
        f"run-to-run spread {100 * check['run_noise']:.1f} %, τ sampling error "
        f"{100 * check.get('tau_noise', 0):.1f} %)"
    )


def _tau(row: dict) -> str:
    """τ, ± its error over requests where the run sampled (T > 0: each run its own texts)."""
    se = row.get("tau_se")
    return f"{row['tau']:.2f} ± {se:.2f}" if row["temperature"] and se else f"{row['tau']:.2f}"


def _num(row: dict, key: str) -> float:
    value = row.get(key)
    return float("nan") if value is None else float(value)


def _temperatures(text: str) -> list[float]:
    from ..core.errors import ConfigError

    try:
        values = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ConfigError(f"--temperature {text}: not a comma-separated list of numbers") from None
    if not values or any(t < 0 for t in values):
        raise ConfigError(f"--temperature {text}: give one or more temperatures >= 0, e.g. 0,1")
    return values


if __name__ == "__main__":
    from ..cli import user_errors

    with user_errors():
        main()
