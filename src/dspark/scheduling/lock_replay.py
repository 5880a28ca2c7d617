"""Whether a load-aware policy can get stuck in plain decoding, replayed on a CPU in seconds.

    python -m dspark.scheduling.lock_replay --cost-table cost_table_T0.json [--policy draft_aware]
        [--rows 256] [--requests 1024] [--runs 4] [--acceptance 0.6,0.64,0.58,0.57,0.6,0.6,0.6]
        [--dip-run 1] [--dip-rounds 3] [--dip-factor 0.5] [--probe-every 0,128] [--seed 0]
        [--out lock_replay.json]

The policy plans every round of a batch run as the engine asks it (``draft_length`` before the
round, its outcome and time reported one round later), over a simulated workload: ``--requests``
requests of 60-200 tokens (at most 128) through ``--rows`` slots, each drafted position accepted
with the ``--acceptance`` of its place, each round taking the cost table's price at the rows'
bucket (times 1 ± 2 % noise, and cheaper when the bucket is part empty). The policy keeps what it
learnt from run to run, as ``e2e``'s repeats do. In run ``--dip-run`` the first ``--dip-rounds``
rounds accept at ``--dip-factor`` times the rates: the unlucky stretch that, with an estimate
only drafting rounds teach, can leave a policy plain for the rest of a run (issue 18's H100 run of
2026-12-06, T = 0, R = 256). Per ``--probe-every`` (``PlainProbe``; 0: no probes) and run: the
rounds, and the plain and drafting rounds at the full bucket. A replay of the policy's logic, not
of the engine: the times and acceptances are the ones given.
"""

from __future__ import annotations

import argparse
from collections import deque

import numpy as np

from .cost import CostModel
from .policies import build_policy, rows_bucket

__all__ = ["main", "replay"]


def replay(
    cost: CostModel,
    policy: str = "draft_aware",
    rows: int = 256,
    requests: int = 1024,
    runs: int = 4,
    acceptance: tuple[float, ...] = (0.6, 0.64, 0.58, 0.57, 0.6, 0.6, 0.6),
    dip_run: int = 1,
    dip_rounds: int = 3,
    dip_factor: float = 0.5,
    probe_every: int = 0,
    seed: int = 0,
) -> list[dict]:
    """Per run: its rounds, and at the full rows bucket its plain rounds and drafting rounds."""
    rng = np.random.default_rng(seed)
    rates = np.asarray(acceptance, dtype=np.float64)
    gamma = rates.size
    pol = build_policy(policy, defaults={"probe_every": probe_every, "check": False})
    lengths = np.minimum(rng.integers(60, 200, size=32), 128)  # 32 prompts' answers, cycled
    full = rows_bucket(rows)
    cost = cost.at_engine_rows([1 << k for k in range(full.bit_length())])  # priced as the fast engine runs
    out = []
    for run in range(runs):
        pol.reset()
        queue, live, pending = deque(range(requests)), [], deque()
        plain = drafting = rounds = 0
        while queue or live:
            while len(live) < rows and queue:
                live.append(int(lengths[queue.popleft() % lengths.size]))
            r = len(live)
            drafted = pol.draft_length(r, gamma, cost)
            scale = dip_factor if run == dip_run and rounds < dip_rounds else 1.0
            ok = rng.random((r, drafted)) < rates[:drafted] * scale
            accepted = np.where(ok.all(1), drafted, np.argmin(ok, 1)) if drafted else np.zeros(r, np.int64)
            ms = 1e3 * cost.round_seconds(r, drafted)[drafted] * rng.normal(1.0, 0.02)
            pending.append((np.full(r, drafted), accepted, ms * (0.5 + 0.5 * r / rows_bucket(r))))
            if rows_bucket(r) == full:
                plain, drafting = plain + (drafted == 0), drafting + (drafted > 0)
            live = [n for n in (n - 1 - int(a) for n, a in zip(live, accepted)) if n > 0]
            rounds += 1
            while len(pending) > (1 if queue or live else 0):  # reported one round late
                verified, acc, took = pending.popleft()
                pol.observe_round(verified, acc)
                pol.observe_time(took)
        out.append({"run": run, "rounds": rounds, "plain_at_load": plain, "drafting_at_load": drafting})
    return out


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def main(argv=None) -> dict:
    from ..core.io import atomic_write_json

    ap = argparse.ArgumentParser(
        prog="python -m dspark.scheduling.lock_replay", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--cost-table", required=True, help="a cost table (engine_sps --cost-table)")
    ap.add_argument("--policy", default="draft_aware", choices=["draft_aware", "hardware_aware"])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--acceptance", default="0.6,0.64,0.58,0.57,0.6,0.6,0.6", help="per draft position")
    ap.add_argument("--dip-run", type=int, default=1)
    ap.add_argument("--dip-rounds", type=int, default=3)
    ap.add_argument("--dip-factor", type=float, default=0.5)
    ap.add_argument("--probe-every", default="0,128", help="comma list (0: no probes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.rows < 1 or args.requests < 1 or args.runs < 1 or not 0 < args.dip_factor <= 1:
        ap.error("--rows, --requests and --runs must be >= 1 and --dip-factor in (0, 1]")
    acceptance = _floats(args.acceptance)
    if not acceptance or not all(0 <= a <= 1 for a in acceptance):
        ap.error(f"--acceptance {args.acceptance}: give rates in [0, 1], one per draft position")
    try:
        probes = [int(x) for x in args.probe_every.split(",") if x.strip()]
    except ValueError:
        probes = []
    if not probes or min(probes) < 0:
        ap.error(f"--probe-every {args.probe_every}: give plain-round counts >= 0, e.g. 0,128")
    cost = CostModel.load(args.cost_table)
    report = {"args": vars(args), "replays": {}}
    print("| probe_every | run | rounds | plain at the load | drafting at the load |")
    print("|---:|---:|---:|---:|---:|")
    for every in probes:
        runs = replay(
            cost, args.policy, args.rows, args.requests, args.runs, acceptance, args.dip_run,
            args.dip_rounds, args.dip_factor, every, args.seed,
        )  # fmt: skip
        report["replays"][str(every)] = runs
        for r in runs:
            print(
                f"| {every} | {r['run']} | {r['rounds']} | {r['plain_at_load']} | {r['drafting_at_load']} |"
            )
    if args.out:
        atomic_write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
