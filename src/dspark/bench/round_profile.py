"""Where the host's time in a decode round goes: the engine's rounds under cProfile.

    python -m dspark.bench.round_profile --drafter-dir <checkpoint> target=smollm2_135m \\
        target.device=cuda [--concurrency 16,256] [--temperature 0,1] \\
        [--policy fixed|fixed_0|target_only|...] [--max-new-tokens 64] [--top 25] [--no-compile] \\
        [--out round_profile.json]

At large R the host's work per round (launching the draft and target graphs, verification, the
outcome's copies, per-request bookkeeping) can outlast the device's, and the device then idles
between rounds (``gap_ms`` in ``bench.e2e``). For each temperature and R this builds the engine,
runs one untimed generate of the prompts (repeated to fill R rows), then one whose rounds (the
engine's ``_launch``, ``_complete`` and ``_retire``; not the prefill) run under cProfile, and
reports the host's milliseconds per round (the engine's own ``host_ms``) and the functions that
spend them: own time and cumulative time per round, the heaviest first. The profiler's own cost
inflates Python-heavy functions, so read the ranking, not the absolute microseconds.
"""

from __future__ import annotations

import argparse
import cProfile
import logging
import pstats

log = logging.getLogger(__name__)

ROUND_METHODS = ("_launch", "_complete", "_retire")  # a round's host work, prefill aside


def _parse(argv):
    from ..data.benchmarks import PACKAGED_BENCHMARKS

    prog, about = "python -m dspark.bench.round_profile", __doc__.split("\n")[0]
    ap = argparse.ArgumentParser(prog=prog, description=about)
    ap.add_argument("--drafter-dir", required=True)
    ap.add_argument("--benchmark", default="gsm8k")
    ap.add_argument("--benchmark-dir", default=PACKAGED_BENCHMARKS)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--concurrency", default="16,256")
    ap.add_argument("--temperature", default="0,1")
    ap.add_argument(
        "--policy", default="fixed",
        help="a policy name (fixed_0: plain rounds of an engine that carries the drafter) or target_only",
    )  # fmt: skip
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--cost-table", default=None, help="for a policy that needs one")
    ap.add_argument("--out", default="round_profile.json")
    return ap.parse_known_args(argv)


def profile_rounds(engine, requests, top: int) -> dict:
    """One warm generate of ``requests`` under cProfile: the host's ms per round and the ``top``
    functions by own time (µs per round, with their cumulative time and calls per round)."""
    engine.generate(requests)  # untimed: first-use costs out of the profile
    prof = cProfile.Profile()

    def profiled(method):
        def run(*args, **kwargs):
            prof.enable()
            try:
                return method(*args, **kwargs)
            finally:
                prof.disable()

        return run

    for name in ROUND_METHODS:  # instance attributes over the class's methods, for this generate
        setattr(engine, name, profiled(getattr(engine, name)))
    try:
        res = engine.generate(requests)
    finally:
        for name in ROUND_METHODS:
            delattr(engine, name)
    rounds = max(len(res.steps), 1)
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (calls, primitive, own s, cumulative s, callers)
    rows = [
        {
            "function": _label(key),
            "own_us": 1e6 * own / rounds,
            "cumulative_us": 1e6 * cum / rounds,
            "calls": calls / rounds,
        }
        for key, (_, calls, own, cum, _) in stats.items()
    ]
    rows.sort(key=lambda r: -r["own_us"])
    host = [s["host_ms"] for s in res.steps if s.get("host_ms") is not None]
    return {
        "rounds": len(res.steps),
        "host_ms_per_round": sum(host) / max(len(host), 1),
        "ms_per_round": sum(s["ms"] for s in res.steps) / rounds,
        "profiled_ms_per_round": 1e3 * sum(own for _, _, own, _, _ in stats.values()) / rounds,
        "top": rows[:top],
    }


def _label(key: tuple) -> str:
    """``module.py:line(name)`` with the path cut to the package (or ``~`` for built-ins)."""
    path, line, name = key
    if path == "~":
        return name
    for root in ("dspark/", "torch/", "triton/", "site-packages/"):
        if root in path:
            path = path[path.rindex(root) :]
            break
    return f"{path}:{line}({name})"


def main(argv=None) -> dict:
    import sys

    from ..checkpoints import load_drafter
    from ..core.io import atomic_write_json
    from ..data.benchmarks import first_turns
    from ..decoding.engine import Request
    from ..decoding.fast_engine import FastEngine
    from ..scheduling.cost import CostModel
    from ..scheduling.policies import build_policy
    from ..target import load_target
    from .common import compose_target, report_header

    argv = sys.argv[1:] if argv is None else argv
    args, overrides = _parse(argv)
    texts = first_turns(args.benchmark, args.benchmark_dir, args.prompts)
    cost = CostModel.load(args.cost_table) if args.cost_table else None
    target = load_target(compose_target(overrides))
    drafter, _ = load_drafter(args.drafter_dir, target, device=target.device)
    drafter = drafter.to(target.dtype)  # served in the target's precision, as bench.e2e does
    prompts = [target.prompt_ids(t) for t in texts]
    report = {**report_header("dspark.bench.round_profile", argv, target, args.compile), "points": []}
    for temperature in (float(t) for t in args.temperature.split(",")):
        for R in (int(r) for r in args.concurrency.split(",")):
            alone = args.policy == "target_only"  # the engine without a drafter: the baseline's rounds
            engine = FastEngine(
                target, None if alone else drafter, None if alone else build_policy(args.policy),
                temperature=temperature, concurrency=R,
                max_new_tokens=args.max_new_tokens, cost=cost, buckets=(R,), compile=args.compile,
            )  # fmt: skip
            n = max(R, len(prompts))
            reqs = [Request(prompt=list(prompts[i % len(prompts)]), id=i) for i in range(n)]
            engine.prepare(reqs)
            point = {"temperature": temperature, "concurrency": R, "policy": args.policy}
            point.update(profile_rounds(engine, reqs, args.top))
            report["points"].append(point)
            atomic_write_json(args.out, report)
            print(
                f"\nT={temperature:g} R={R} {args.policy}: {point['rounds']} rounds, host "
                f"{point['host_ms_per_round']:.3f} ms a round (round {point['ms_per_round']:.3f} ms); "
                f"µs per round under the profiler:"
            )
            print(f"{'own':>8} {'cumul':>8} {'calls':>6}  function")
            for row in point["top"]:
                own, cum, calls = row["own_us"], row["cumulative_us"], row["calls"]
                print(f"{own:8.1f} {cum:8.1f} {calls:6.1f}  {row['function']}")
    return report


if __name__ == "__main__":
    from ..cli import user_errors

    logging.basicConfig(level=logging.INFO)
    with user_errors():
        main()
