"""Training throughput of each drafter: the real ``python -m dspark.train`` once per drafter.

    python -m dspark.bench.train_throughput [--drafters dflash,dspark:markov,dspark:gated,dspark:rnn,eagle3]
        [--steps 60] [--work outputs/bench/train_throughput] [--out train_throughput.json] \\
        [overrides... default: experiment=cpu_smoke]

Each run uses the same data, steps and overrides; the numbers come from the run's own
``summary.json`` (the Throughput callback): tokens/s and samples/s over the whole run, and in steady
state (after the callback's warm-up steps, validation time excluded). Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path


def _parse(argv):
    ap = argparse.ArgumentParser(prog="python -m dspark.bench.train_throughput")
    ap.add_argument("--drafters", default="dflash,dspark:markov,dspark:gated,dspark:rnn,eagle3")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--work", default="outputs/bench/train_throughput")
    ap.add_argument("--out", default="train_throughput.json")
    return ap.parse_known_args(argv)


def _overrides(spec: str) -> list[str]:
    name, _, head = spec.partition(":")
    out = [f"drafter={name}"]
    if name == "dspark":
        out.append(f"head={head or 'markov'}")
    elif head:
        raise SystemExit(f"{spec}: only dspark takes a head (dflash and eagle3 have none)")
    return out


def main(argv=None) -> dict:
    from ..artifacts import RunFolder
    from ..core.provenance import provenance
    from .common import publish

    argv = sys.argv[1:] if argv is None else argv
    args, extra = _parse(argv)
    extra = extra or ["experiment=cpu_smoke"]
    if not any(o.startswith("data.dir=") for o in extra):  # one dataset of its own, built by the first run
        extra = [*extra, f"data.dir={Path(args.work) / 'data'}"]
    rows = []
    for spec in args.drafters.split(","):
        run_dir = Path(args.work) / spec.replace(":", "-")
        cmd = [sys.executable, "-m", "dspark.train", *extra, *_overrides(spec)]
        cmd += [f"trainer.max_steps={args.steps}", "trainer.max_time=null", f"hydra.run.dir={run_dir}"]
        t0 = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"{spec} failed:\n{done.stderr[-3000:]}")
        summary = RunFolder(run_dir).read_summary()
        tp = summary["throughput"]
        steady = tp.get("steady") or {}
        rows.append(
            {
                "drafter": spec,
                "steps": summary["global_step"],
                "tokens_per_s": tp["tokens_per_s"],
                "samples_per_s": tp["samples_per_s"],
                "steady_tokens_per_s": steady.get("tokens_per_s"),
                "steady_samples_per_s": steady.get("samples_per_s"),
                "process_wall_s": time.perf_counter() - t0,
                "command": " ".join(["python -m dspark.train", *cmd[3:]]),
            }
        )
        print(f"{spec}: {rows[-1]['tokens_per_s']:.0f} tokens/s", flush=True)
    import torch

    report = {**provenance("dspark.bench.train_throughput", argv, torch.device("cpu")), "rows": rows}
    publish(
        args.out,
        report,
        ["drafter", "steps", "tokens/s", "samples/s", "steady tokens/s", "process wall s"],
        [
            [r["drafter"], f"{r['steps']}", f"{r['tokens_per_s']:.0f}", f"{r['samples_per_s']:.2f}",
             "n/a" if r["steady_tokens_per_s"] is None else f"{r['steady_tokens_per_s']:.0f}",
             f"{r['process_wall_s']:.0f}"]
            for r in rows
        ],
    )  # fmt: skip
    return report


if __name__ == "__main__":
    from ..cli import user_errors

    with user_errors():
        main()
