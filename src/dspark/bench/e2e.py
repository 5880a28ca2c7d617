"""End-to-end decoding speed in one engine: target-only vs speculative decoding with a drafter.

    python -m dspark.bench.e2e --drafter-dir <checkpoint> target=smollm2_135m target.device=cuda \\
        [--engine fast] [--benchmark gsm8k] [--benchmark-dir <folder>] [--prompts 32] \\
        [--concurrency 1,64,256] [--max-new-tokens 128] [--temperature 0] \\
        [--policies fixed,hardware_aware --cost-table cost_table.json] [--out e2e.json]

For each concurrency R the same prompts (repeated to fill R slots) run target-only and with the
drafter under each policy. Reported per run, from the engine's own round timings (prefill excluded,
as in ``python -m dspark.schedule mode=measured``): aggregate tokens/s, mean tokens/s per user, τ;
and the drafter's speed-up over target-only at the same R.
"""

from __future__ import annotations

import argparse

from ..data.benchmarks import PACKAGED_BENCHMARKS


def _parse(argv):
    ap = argparse.ArgumentParser(prog="python -m dspark.bench.e2e", description=__doc__.split("\n")[0])
    ap.add_argument("--drafter-dir", required=True)
    ap.add_argument("--engine", default="fast", choices=["plain", "fast"])
    ap.add_argument("--benchmark", default="gsm8k")
    ap.add_argument("--benchmark-dir", default=PACKAGED_BENCHMARKS, help="default: the suites dspark ships")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--concurrency", default="1,64,256")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--policies", default="fixed")
    ap.add_argument("--cost-table", default=None, help="needed by hardware_aware / async_topk")
    ap.add_argument("--drafter-dtype", default="target", choices=["target", "float32"])
    ap.add_argument("--compile", action="store_true", help="torch.compile the fast engine's target layers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="e2e.json")
    return ap.parse_known_args(argv)


def main(argv=None) -> dict:
    import sys

    from ..artifacts import DrafterFolder
    from ..checkpoints import load_drafter
    from ..core.provenance import provenance
    from ..data.benchmarks import first_turns
    from ..scheduling.cost import CostModel
    from ..scheduling.policies import Fixed, build_policy
    from ..target import load_target
    from .common import compose_target, publish
    from .measure import measure, speedup_rows

    argv = sys.argv[1:] if argv is None else argv
    args, overrides = _parse(argv)
    target_cfg = compose_target(overrides)
    texts = first_turns(args.benchmark, args.benchmark_dir, args.prompts)  # fails fast on a bad name
    cost = CostModel.load(args.cost_table) if args.cost_table else None
    target = load_target(target_cfg)
    drafter, _ = load_drafter(args.drafter_dir, target, device=target.device)
    if args.drafter_dtype == "target":  # serve the drafter in the target's precision
        drafter = drafter.to(target.dtype)
    calibration = DrafterFolder(args.drafter_dir).read_calibration()
    prompts = [target.prompt_ids(t) for t in texts]
    gamma = int(drafter.gamma)
    policies = {p: build_policy(p, gamma=gamma, defaults={"check": False}) for p in args.policies.split(",")}
    conc = [int(r) for r in args.concurrency.split(",")]
    common = dict(
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        engine_kind=args.engine,
        engine_kw={"compile": True} if args.compile else None,
    )
    base = measure(target, None, {"target_only": Fixed(None)}, conc, prompts, **common)["target_only"]
    spec = measure(target, drafter, policies, conc, prompts, cost=cost, calibration=calibration, **common)
    rows = speedup_rows(base, spec, drafter.kind)
    report = {
        **provenance("dspark.bench.e2e", argv, target.device),
        "target": target.name,
        "dtype": str(target.dtype).replace("torch.", ""),
        "drafter": str(args.drafter_dir),
        "drafter_dtype": str(next(drafter.parameters()).dtype).replace("torch.", ""),
        "engine": args.engine,
        "compiled": args.compile,
        "benchmark": args.benchmark,
        "prompts": len(prompts),
        "temperature": args.temperature,
        "max_new_tokens": args.max_new_tokens,
        "gamma": gamma,
        "rows": rows,
    }
    publish(
        args.out,
        report,
        ["run", "R", "tok/s/user", "aggregate tok/s", "τ", "speed-up/user", "speed-up aggregate"],
        [
            [row["run"], f"{row['concurrency']}", f"{row['tps_per_user']:.1f}", f"{row['throughput']:.0f}",
             f"{row['tau']:.2f}", f"{row.get('speedup_per_user', 1.0):.2f}x",
             f"{row.get('speedup_throughput', 1.0):.2f}x"]
            for row in rows
        ],
    )  # fmt: skip
    return report


if __name__ == "__main__":
    from ..cli import user_errors

    with user_errors():
        main()
