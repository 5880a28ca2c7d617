"""What a load-aware scheduler did in an e2e run, run by run, read from its JSON on any machine.

    python -m dspark.bench.plans e2e_T0.json [e2e_T1.json ...] [--concurrency 256] [--out plans.json]

For every point of a policy that plans its rounds (``draft_aware``, ``hardware_aware`` and their
variants: the points whose runs carry ``plans``, ``e2e`` since ``6f6bb73``), each repeat's speeds and
its plain and drafting rounds at the load (the rounds at R's rows bucket), then the round's time by
what the round did and what the round before it did, pooled over the repeats: a drafting round right
after a plain one writes the plain rounds' deferred drafter context first (the fast engine's ring) and
its launch is longer than the plain round it follows; a plain round after a drafting one follows a
longer launch. Set beside the same kind of round after one of its own kind, that is the price of
switching, which no cost table holds. And by the length a plan chose, the tokens and time its rounds
took against what the plan expected of them (``estimate_errors``): where a scheduler's choices near a
tie or near break-even went wrong, the estimate or the clock. The other points' rounds at the same
rows bucket are printed beside them, by kind, the kind of the round before and whether the rows
changed (``by_transition``, e2e runs from its commit on; else by kind, ``by_length``): the like
for like comparison. Nothing here is re-measured: it reads what the run recorded.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from ..core.errors import ConfigError
from ..scheduling.policies import rows_bucket
from .measure import rounds_by_transition

__all__ = ["estimate_errors", "main", "runs_summary", "switch_costs"]


def _kind(drafted: int) -> str:
    return "plain" if drafted == 0 else f"γ{drafted}"


def switch_costs(plans: list[dict], concurrency: int) -> list[dict]:
    """Round ms at R's rows bucket by the round's kind (plain, γ_d) and the kind of the round before
    it (``after``: plain or drafting), over the runs' ``plans`` (``measure.rounds_by_transition`` of each
    run's own sequence), of the rounds with as many live rows as the round before: a row that
    ended, left or joined between them (its row idling, rows moved, a prompt prefilled) would time
    that work too. Per (kind, after): rounds, mean and median ms, and on the switching entries
    ``switch_ms``, their mean less that of the same kind after its own kind (None where there is
    none)."""
    runs = [
        [{"ms": ms, "batch": rows, "drafted": d} for d, rows, ms in zip(p["drafted"], p["rows"], p["ms"])]
        for p in plans
    ]
    bucket = rows_bucket(concurrency)
    groups = {
        (g["drafted"], g["after"] == "plain"): g
        for g in rounds_by_transition(*runs)
        if g["rows_bucket"] == bucket and g["rows"] == "same"
    }
    out = []
    for (drafted, after_plain), g in groups.items():
        same = groups.get((drafted, drafted == 0))
        switched = after_plain != (drafted == 0)
        out.append({
            "kind": _kind(drafted),
            "after": g["after"],
            "rounds": g["rounds"],
            "ms_mean": g["ms"],
            "ms_median": g["median_ms"],
            "switch_ms": g["ms"] - same["ms"] if switched and same else None,
        })  # fmt: skip
    return out


def estimate_errors(plans: list[dict], concurrency: int) -> list[dict]:
    """How far the plans' expectations were off, by the length chosen: over the rounds at R's rows
    bucket that verified their whole draft (a walked round's tokens are not the whole draft's), the
    tokens the rounds emitted over those expected, their ms over the expected ms (the table's price
    times the clock's ratio), and the rate's ratio (tokens per ms, realised over expected). Empty
    for runs recorded before the plans kept their expectations (``e2e`` before ``62bc5e9``)."""
    bucket = rows_bucket(concurrency)
    sums: dict[int, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0.0])
    for plan in plans:
        if "expected_tokens" not in plan:
            continue
        rounds = zip(
            plan["drafted"], plan["rows"], plan["walked"], plan["ms"], plan["tokens"],
            plan["expected_tokens"], plan["expected_ms"],
        )  # fmt: skip
        for drafted, rows, walked, ms, tokens, want_tokens, want_ms in rounds:
            if walked or ms is None or want_ms is None or rows_bucket(rows) != bucket:
                continue
            entry = sums[int(drafted)]
            entry[0] += 1
            entry[1] += tokens
            entry[2] += want_tokens
            entry[3] += ms
            entry[4] += want_ms
    out = []
    for drafted, (n, tokens, want_tokens, ms, want_ms) in sorted(sums.items()):
        token_ratio, time_ratio = tokens / want_tokens, ms / want_ms
        out.append({
            "kind": _kind(drafted),
            "rounds": n,
            "tokens_over_expected": token_ratio,
            "ms_over_expected": time_ratio,
            "rate_over_expected": token_ratio / time_ratio,
        })  # fmt: skip
    return out


def runs_summary(row: dict) -> list[dict]:
    """Per repeat: its speeds, and its plain and drafting rounds at R's rows bucket."""
    bucket = rows_bucket(row["concurrency"])
    out = []
    for rep in row["repeats"]:
        plan = rep["plans"]
        at_load = [d for d, r in zip(plan["drafted"], plan["rows"]) if rows_bucket(r) == bucket]
        out.append({
            "tps_per_user": rep["tps_per_user"],
            "throughput": rep["throughput"],
            "plain_at_load": sum(d == 0 for d in at_load),
            "drafting_at_load": sum(d > 0 for d in at_load),
        })  # fmt: skip
    return out


def _rounds_at(row: dict, concurrency: int) -> list[dict]:
    """A point's rounds at R's rows bucket: by kind, the kind of the round before and whether it had
    as many live rows (``by_transition``, in e2e runs from its commit on), else by kind alone
    (``by_length``)."""
    bucket = rows_bucket(concurrency)
    if row.get("by_transition"):
        return [
            {"kind": _kind(b["drafted"]), "after": b["after"], "rows": b["rows"], "rounds": b["rounds"],
             "ms_mean": b["ms"]}
            for b in row["by_transition"] if b["rows_bucket"] == bucket
        ]  # fmt: skip
    return [
        {"kind": _kind(b["drafted"]), "rounds": b["rounds"], "ms_mean": b["ms"]}
        for b in row["by_length"]
        if b["rows_bucket"] == bucket
    ]


def _planned(row: dict) -> bool:
    return bool(row.get("repeats")) and all(isinstance(r.get("plans"), dict) for r in row["repeats"])


WANT = "give an e2e JSON (python -m dspark.bench.e2e --out)"


def _load(path: str) -> dict:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"{path}: no such file; {WANT}")
    try:
        report = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not JSON ({err}); {WANT}") from err
    if not isinstance(report, dict) or not isinstance(report.get("rows"), list):
        raise ConfigError(f"{path}: no 'rows' list; {WANT}")
    return report


def summarise(report: dict, concurrency: set[int] | None = None) -> list[dict]:
    """The planned points of one e2e report (at the given R, or all), with the fixed points' round
    ms at each R's rows bucket beside them."""
    points = []
    for row in report["rows"]:
        R = int(row["concurrency"])
        if (concurrency and R not in concurrency) or not _planned(row):
            continue
        fixed = {
            other["run"]: _rounds_at(other, R)
            for other in report["rows"]
            if other["concurrency"] == R and not _planned(other) and other.get("by_length")
        }
        points.append({
            "temperature": row["temperature"],
            "concurrency": R,
            "run": row["run"],
            "runs": runs_summary(row),
            "switches": switch_costs([rep["plans"] for rep in row["repeats"]], R),
            "estimates": estimate_errors([rep["plans"] for rep in row["repeats"]], R),
            "fixed_rounds": fixed,
        })  # fmt: skip
    return points


def _print(points: list[dict]) -> None:
    for p in points:
        runs = " ".join(
            f"{r['tps_per_user']:.0f}/{r['throughput'] / 1e3:.1f}k "
            f"({r['plain_at_load']}p {r['drafting_at_load']}d)"
            for r in p["runs"]
        )
        print(f"T={p['temperature']:g} R={p['concurrency']} {p['run']}: runs (tok/s/user / aggregate, "
              f"plain / drafting rounds at the load) {runs}")  # fmt: skip
        for s in p["switches"]:
            extra = "" if s["switch_ms"] is None else f", {s['switch_ms']:+.3f} ms against after its own kind"
            print(f"    {s['kind']} after {s['after']}: {s['rounds']} rounds, "
                  f"{s['ms_mean']:.3f} ms mean / {s['ms_median']:.3f} median{extra}")  # fmt: skip
        for e in p["estimates"]:
            print(f"    {e['kind']} as planned ({e['rounds']} whole-draft rounds): tokens "
                  f"{e['tokens_over_expected']:.3f}x the expected, ms {e['ms_over_expected']:.3f}x, "
                  f"rate {e['rate_over_expected']:.3f}x")  # fmt: skip
    shown = set()
    for p in points:
        key = (p["temperature"], p["concurrency"])
        if key in shown or not p["fixed_rounds"]:
            continue
        shown.add(key)
        print(f"T={key[0]:g} R={key[1]} the other points' rounds at the bucket (mean):")
        for run, rounds in p["fixed_rounds"].items():
            cells = ", ".join(
                f"{b['kind']}{_after(b)} {b['rounds']} rounds {b['ms_mean']:.3f} ms" for b in rounds
            )
            print(f"    {run}: {cells}")


def _after(entry: dict) -> str:
    return f" after {entry['after']} ({entry['rows']} rows)" if "after" in entry else ""


def main(argv=None) -> list[dict]:
    from ..core.io import atomic_write_json

    ap = argparse.ArgumentParser(prog="python -m dspark.bench.plans", description=__doc__.split("\n")[0])
    ap.add_argument("e2e", nargs="+", help="e2e JSONs (python -m dspark.bench.e2e --out)")
    ap.add_argument("--concurrency", default=None, help="comma list of R to show (default: all)")
    ap.add_argument("--out", default=None, help="write the summary as JSON")
    args = ap.parse_args(argv)
    try:
        wanted = {int(x) for x in args.concurrency.split(",") if x.strip()} if args.concurrency else None
    except ValueError:
        wanted = None
    if args.concurrency and not wanted:
        ap.error(f"--concurrency {args.concurrency}: give R values, comma-separated, e.g. 64,256")
    try:
        reports = [(path, _load(path)) for path in args.e2e]
    except ConfigError as err:
        ap.error(str(err))
    points = []
    for path, report in reports:
        found = summarise(report, wanted)
        if not found:
            print(f"{path}: no point of a planning policy with per-round plans in its repeats")
        points += [{"e2e": path, **p} for p in found]
    _print(points)
    if args.out:
        atomic_write_json(args.out, points)
    return points


if __name__ == "__main__":
    main()
