"""Whether a load-aware policy can get stuck in plain decoding, replayed on a CPU in seconds.

    python -m dspark.scheduling.lock_replay --cost-table cost_table_T0.json [--policy draft_aware,fixed_3]
        [--rows 256] [--requests 1024] [--runs 4] [--acceptance 0.6,0.64,0.58,0.57,0.6,0.6,0.6]
        [--dip-run 1] [--dip-rounds 3] [--dip-factor 0.5] [--phase-dip 15,40,0.8]
        [--probe-every 0,128] [--seed 0] [--out lock_replay.json]

The policy plans every round of a batch run as the engine asks it (``draft_length`` before the
round, its outcome and time reported one round later), over a simulated workload: ``--requests``
requests of 60-200 tokens (at most 128) through ``--rows`` slots, each drafted position accepted
with the ``--acceptance`` of its place, each round taking the cost table's price at the rows'
bucket (times 1 ± 2 % noise, and cheaper when the bucket is part empty). The policy keeps what it
learnt from run to run, as ``e2e``'s repeats do. In run ``--dip-run`` the first ``--dip-rounds``
rounds accept at ``--dip-factor`` times the rates: the unlucky stretch that, with an estimate
only drafting rounds teach, can leave a policy plain for the rest of a run (issue 18's H100 run of
2026-12-06, T = 0, R = 256). With ``--phase-dip START,END,FACTOR`` every answer's tokens START to
END - 1 accept at FACTOR times the rates, in every run: a stretch each request passes through, which
the requests of a batch that start together pass through together (the H100 run of 2026-12-06-b:
its plans show the estimate falling in a run's rounds 7-15, answers' tokens ~15-40). Per policy
(fixed lengths beside the load-aware ones, as references), ``--probe-every`` (``PlainProbe``; 0: no
probes) and run: the rounds, their simulated ms, and the plain and drafting rounds at the full
bucket. A replay of the policy's logic, not of the engine: the times and acceptances are the ones
given.
"""

from __future__ import annotations

import argparse
from collections import deque

import numpy as np

from ..core.errors import ConfigError
from .cost import CostModel
from .policies import build_policy, rows_bucket

__all__ = ["main", "replay"]

LOAD_AWARE = ("draft_aware", "hardware_aware")


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
    phase_dip: tuple[int, int, float] | None = None,
    seed: int = 0,
) -> list[dict]:
    """Per run: its rounds and their simulated ms, and at the full rows bucket its plain rounds and
    drafting rounds."""
    rng = np.random.default_rng(seed)
    rates = np.asarray(acceptance, dtype=np.float64)
    gamma = rates.size
    pol = build_policy(policy, defaults={"probe_every": probe_every, "check": False})  # a name's own wins
    lengths = np.minimum(rng.integers(60, 200, size=32), 128)  # 32 prompts' answers, cycled
    full = rows_bucket(rows)
    cost = cost.at_engine_rows([1 << k for k in range(full.bit_length())])  # priced as the fast engine runs
    out = []
    for run in range(runs):
        pol.reset()
        # live: per request in a slot, [tokens left, tokens produced]
        queue, live, pending = deque(range(requests)), [], deque()
        plain = drafting = rounds = 0
        clock = 0.0  # the run's simulated ms
        while queue or live:
            while len(live) < rows and queue:
                live.append([int(lengths[queue.popleft() % lengths.size]), 0])
            r = len(live)
            drafted = pol.draft_length(r, gamma, cost)
            scale = np.full((r, 1), dip_factor if run == dip_run and rounds < dip_rounds else 1.0)
            if phase_dip is not None:
                start, end, factor = phase_dip
                scale[[start <= made < end for _, made in live]] *= factor
            ok = rng.random((r, drafted)) < rates[:drafted] * scale
            accepted = np.where(ok.all(1), drafted, np.argmin(ok, 1)) if drafted else np.zeros(r, np.int64)
            ms = 1e3 * cost.round_seconds(r, drafted)[drafted] * rng.normal(1.0, 0.02)
            ms *= 0.5 + 0.5 * r / rows_bucket(r)
            clock += ms
            pending.append((np.full(r, drafted), accepted, ms))
            if rows_bucket(r) == full:
                plain, drafting = plain + (drafted == 0), drafting + (drafted > 0)
            live = [[n - 1 - int(a), made + 1 + int(a)] for (n, made), a in zip(live, accepted) if n > 1 + a]
            rounds += 1
            while len(pending) > (1 if queue or live else 0):  # reported one round late
                verified, acc, took = pending.popleft()
                pol.observe_round(verified, acc)
                pol.observe_time(took)
        out.append(
            {
                "run": run,
                "rounds": rounds,
                "ms": round(clock, 3),
                "plain_at_load": plain,
                "drafting_at_load": drafting,
            }
        )
    return out


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def _policies(text: str, gamma: int) -> list[str]:
    """The comma list's names, each a load-aware policy (or a variant of one,
    ``draft_aware:keep_margin=0.02``) or a fixed length (``fixed_<g>``, g <= γ)."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    for name in names:
        g = name[len("fixed_") :] if name.startswith("fixed_") else None
        if not _load_aware(name) and not (g is not None and g.isdigit() and int(g) <= gamma):
            return []
    return names


def _load_aware(name: str) -> bool:
    return name.split(":")[0] in LOAD_AWARE


def _probe_settings(name: str, probes: list[int]) -> list[int]:
    """The ``--probe-every`` settings a policy replays under: each for a load-aware policy, its own
    alone for a variant that names one (``draft_aware:probe_every=128``), none (0) for a fixed length."""
    if not _load_aware(name):
        return [0]
    own = build_policy(name).probe_every if "probe_every=" in name else None
    return probes if own is None else [own]


def main(argv=None) -> dict:
    from ..core.io import atomic_write_json

    ap = argparse.ArgumentParser(
        prog="python -m dspark.scheduling.lock_replay", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--cost-table", required=True, help="a cost table (engine_sps --cost-table)")
    ap.add_argument(
        "--policy",
        default="draft_aware",
        help="comma list: draft_aware, hardware_aware (or variants, draft_aware:keep_margin=0.02), fixed_<g>",
    )
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--acceptance", default="0.6,0.64,0.58,0.57,0.6,0.6,0.6", help="per draft position")
    ap.add_argument("--dip-run", type=int, default=1)
    ap.add_argument("--dip-rounds", type=int, default=3)
    ap.add_argument("--dip-factor", type=float, default=0.5)
    ap.add_argument(
        "--phase-dip", default=None, help="START,END,FACTOR: answers' tokens START..END-1 at FACTOR"
    )
    ap.add_argument("--probe-every", default="0,128", help="comma list (0: no probes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.rows < 1 or args.requests < 1 or args.runs < 1 or not 0 < args.dip_factor <= 1:
        ap.error("--rows, --requests and --runs must be >= 1 and --dip-factor in (0, 1]")
    acceptance = _floats(args.acceptance)
    if not acceptance or not all(0 <= a <= 1 for a in acceptance):
        ap.error(f"--acceptance {args.acceptance}: give rates in [0, 1], one per draft position")
    policies = _policies(args.policy, len(acceptance))
    if not policies:
        ap.error(
            f"--policy {args.policy}: give draft_aware, hardware_aware or fixed_<g> (g <= {len(acceptance)}, "
            "the positions --acceptance gives), comma-separated"
        )
    for name in policies:  # a variant's arguments, checked before any replay runs
        try:
            build_policy(name)
        except ConfigError as err:
            ap.error(f"--policy {name}: {err}")
    try:
        probes = [int(x) for x in args.probe_every.split(",") if x.strip()]
    except ValueError:
        probes = []
    if not probes or min(probes) < 0:
        ap.error(f"--probe-every {args.probe_every}: give plain-round counts >= 0, e.g. 0,128")
    phase = None
    if args.phase_dip is not None:
        parts = args.phase_dip.split(",")
        try:
            phase = (int(parts[0]), int(parts[1]), float(parts[2])) if len(parts) == 3 else None
        except ValueError:
            phase = None
        if phase is None or not 0 <= phase[0] < phase[1] or not 0 <= phase[2] <= 1:
            ap.error(
                f"--phase-dip {args.phase_dip}: give START,END,FACTOR with 0 <= START < END, FACTOR in [0, 1]"
            )
    cost = CostModel.load(args.cost_table)
    report = {"args": vars(args), "replays": []}
    print("| policy | probe_every | run | rounds | ms | plain at the load | drafting at the load |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for policy in policies:
        for every in _probe_settings(policy, probes):
            runs = replay(
                cost, policy, args.rows, args.requests, args.runs, acceptance, args.dip_run,
                args.dip_rounds, args.dip_factor, every, phase, args.seed,
            )  # fmt: skip
            report["replays"].append({"policy": policy, "probe_every": every, "runs": runs})
            for r in runs:
                cells = [policy, every, r["run"], r["rounds"], f"{r['ms']:.0f}", r["plain_at_load"]]
                print("| " + " | ".join(map(str, cells + [r["drafting_at_load"]])) + " |")
    print("\nms over the runs:")
    for entry in report["replays"]:
        total = sum(r["ms"] for r in entry["runs"])
        print(f"  {entry['policy']} probe_every={entry['probe_every']}: {total:.0f}")
    if args.out:
        atomic_write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
