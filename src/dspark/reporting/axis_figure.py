"""τ by domain along one config key, a line per drafter family: the paper's Fig. 3 (DSpark's depth
against DFlash at 5 layers) and Fig. 4's τ panel (the block size, per family).

    python -m dspark.report mode=tau_by_axis runs=[<run and evaluation folders>] [axis=drafter.num_layers]

A family evaluated at a single value of the key (the 5-layer DFlash of Fig. 3) is drawn as a dashed
level across the panel: the reference the others are read against.

Beside the figure, the differences it shows, paired on the same prompts where the evaluations carry
each request's totals (their difficulty, common to both, cancels; ``paired_comparison``): each family
against each weaker one at every value, every point against a level, each family from one value to the
next.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless nodes and CI
import matplotlib.pyplot as plt  # noqa: E402

from ..core.io import atomic_write_text  # noqa: E402
from ..decoding.uncertainty import paired_comparison, paired_contrast  # noqa: E402
from .plots import save_figure  # noqa: E402
from .runs import CATEGORY_ORDER, AxisError, Run, SweepAxis, sweep_axis  # noqa: E402
from .tables import DOMAIN_ORDER  # noqa: E402

__all__ = ["paired_differences", "paired_table", "tau_by_axis", "tau_points"]

PANELS = (*DOMAIN_ORDER, "all")


def tau_points(runs: Sequence[Run], axis: SweepAxis) -> list[dict]:
    """One point per run and evaluation: its family (the series label), the key's value, the
    temperature, and macro τ with its standard error per domain. Two evaluations of one family at
    one value and temperature (another policy or γ) would be one point twice: refused by name."""
    points, seen = [], {}
    for run in axis.order(runs):
        for ev in run.evaluations:
            res = ev.results
            point = {
                "series": axis.series_label(run) or _family(run),
                "value": axis.value(run),
                "temperature": res.get("temperature"),
                "evaluation": ev.path.name,
                "tau": {d: (res.get("macro") or {}).get(d) for d in PANELS},
                "stderr": {d: (res.get("macro_stderr") or {}).get(d) for d in PANELS},
                "_totals": {n: b.get("request_totals") for n, b in (res.get("benchmarks") or {}).items()},
            }
            key = (point["series"], repr(point["value"]), point["temperature"])
            if key in seen:
                raise AxisError(
                    f"{seen[key]} and {ev.path} are both {point['series']} at {axis.key}={point['value']}, "
                    f"T = {point['temperature']}: give one evaluation per family, value and temperature"
                )
            seen[key] = ev.path
            points.append(point)
    return points


def _family_order(series: str) -> tuple:
    """Weaker families first (Eagle3, DFlash, DSpark), so a pair reads "dspark … against dflash …"."""
    order = CATEGORY_ORDER["drafter.name"]
    first = series.split(" ")[0]
    return (order.index(first) if first in order else len(order), series)


def _totals(*points: dict) -> list[dict] | None:
    """The points' per-request totals, or None where one was written before they were recorded."""
    totals = [p["_totals"] for p in points]
    return None if any(not t or any(v is None for v in t.values()) for t in totals) else totals


def _compare(row: dict, base: dict, kind: str) -> dict | None:
    if (totals := _totals(row, base)) is None:
        return None
    try:
        c = paired_comparison(*totals)
    except ValueError:  # other prompts or benchmarks: nothing pairs
        return None
    return {
        "kind": kind,
        "temperature": row["temperature"],
        "row": {"series": row["series"], "value": row["value"]},
        "baseline": {"series": base["series"], "value": base["value"]},
        "difference": c["difference"],
        "stderr": c["difference_stderr"],
        "ratio": c["ratio"],
        "ratio_stderr": c["ratio_stderr"],
    }


def _gap(new: tuple[dict, dict], old: tuple[dict, dict]) -> dict | None:
    """How much family A's lead over B grows from ``old``'s value to ``new``'s: (A − B)_new − (A − B)_old,
    each (A, B), paired over the four evaluations (the paper's "the gap widens with γ")."""
    if (totals := _totals(*new, *old)) is None:
        return None
    try:
        c = paired_contrast(totals, [1, -1, -1, 1])
    except ValueError:
        return None
    lead = f"{new[0]['series']} − {new[1]['series']}"
    return {
        "kind": "gap",
        "temperature": new[0]["temperature"],
        "row": {"series": lead, "value": new[0]["value"]},
        "baseline": {"series": lead, "value": old[0]["value"]},
        "difference": c["value"],
        "stderr": c["stderr"],
        "ratio": None,
        "ratio_stderr": None,
    }


def _gaps(at_t: Sequence[dict], families: Sequence[str]) -> list[dict | None]:
    """Each family's lead over each weaker one, from the nearest earlier shared value it pairs at."""
    out = []
    for j, strong in enumerate(families):
        for weak in families[:j]:
            at = {p["value"]: p for p in at_t if p["series"] == weak}
            both = sorted(
                (p["value"], (p, at[p["value"]])) for p in at_t if p["series"] == strong and p["value"] in at
            )
            for n in range(1, len(both)):
                earlier = (_gap(both[n][1], both[m][1]) for m in range(n - 1, -1, -1))
                out.append(next((c for c in earlier if c is not None), None))
    return out


def paired_differences(points: Sequence[dict], levels: Sequence[str] = ()) -> list[dict]:
    """Macro τ (all benchmarks) differences, paired on the same prompts: ``families``, each family
    against each weaker one at one value and temperature; ``level``, every point of the other families
    against a family drawn as a level (Fig. 3's DFlash at 5 layers); ``axis``, each family from the
    nearest earlier value its evaluation pairs with to the next; ``gap``, how much each family's lead
    over each weaker one grows from the nearest earlier value where the four evaluations pair (its
    ``difference``; no ratio). Evaluations that do not pair (no per-request totals, other prompts: a
    row from another protocol's session) are left out."""
    out = []
    for t in sorted({p["temperature"] for p in points}):
        at_t = [p for p in points if p["temperature"] == t]
        for level in (p for p in at_t if p["series"] in levels):
            out += [_compare(p, level, "level") for p in at_t if p["series"] not in levels]
        for v in sorted({p["value"] for p in at_t}):  # a level's pairs are the level's own
            fams = [p for p in at_t if p["value"] == v and p["series"] not in levels]
            fams.sort(key=lambda p: _family_order(p["series"]))
            out += [_compare(fams[j], fams[i], "families") for j in range(len(fams)) for i in range(j)]
        families = sorted({p["series"] for p in at_t}, key=_family_order)
        for fam in families:
            line = sorted((p for p in at_t if p["series"] == fam), key=lambda p: p["value"])
            for j in range(1, len(line)):  # against the nearest earlier value that pairs
                earlier = (_compare(line[j], line[i], "axis") for i in range(j - 1, -1, -1))
                out.append(next((c for c in earlier if c is not None), None))
        out += _gaps(at_t, [f for f in families if f not in levels])
    return [c for c in out if c is not None]


def _paired_markdown(pairs: Sequence[dict], key: str) -> str:
    if not pairs:
        return ""
    lines = [
        "",
        "Paired on the same prompts (macro τ, all benchmarks; ± one standard error): families at one "
        f"value of {key}, each point against a level, each family along {key}, and how much a family's "
        "lead over another grows along it (row A − B):",
        "",
        "| T | row | baseline | difference | ratio |",
        "|---|---|---|---|---|",
    ]

    def pm(value: float | None, err: float | None, fmt: str) -> str:
        if value is None:
            return "–"
        return format(value, fmt) + ("" if err is None else f" ± {err:.3f}")

    for c in pairs:
        row, base = (f"{x['series']} {key.split('.')[-1]}={x['value']}" for x in (c["row"], c["baseline"]))
        diff, ratio = pm(c["difference"], c["stderr"], "+.3f"), pm(c["ratio"], c["ratio_stderr"], ".3f")
        lines.append(f"| {c['temperature']:g} | {row} | {base} | {diff} | {ratio} |")
    return "\n".join(lines) + "\n"


def _levels(points: Sequence[dict]) -> list[str]:
    """Families evaluated at a single value where the others span several: drawn as a level."""
    values = {p["value"] for p in points}
    families = list(dict.fromkeys(p["series"] for p in points))
    return [
        f for f in families if len(values) > 1 and len({p["value"] for p in points if p["series"] == f}) == 1
    ]


def paired_table(runs: Sequence[Run], axis: SweepAxis) -> str:
    """The paired differences' markdown for a dashboard's sweep section ("" where nothing pairs, or
    where a family has two evaluations at one value and temperature: another policy or γ)."""
    try:
        points = tau_points(runs, axis)
    except AxisError:
        return ""
    return _paired_markdown(paired_differences(points, _levels(points)), axis.key).lstrip("\n")


def _family(run: Run) -> str:
    """A run's drafter family ("dspark markov", "dflash none"): the line's name when the runs split
    into no series, as one family's block-size sweep does."""
    names = (run.flat.get("drafter.name"), run.flat.get("head.name"))
    return " ".join(str(n) for n in names if n is not None) or "runs"


def _cell(tau: float | None, stderr: float | None) -> str:
    if tau is None:
        return "–"
    return f"{tau:.2f}" if stderr is None else f"{tau:.2f} ± {stderr:.2f}"


def _markdown(points: Sequence[dict], key: str) -> str:
    head = ["family", key, "T", *(f"τ {d}" for d in PANELS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in sorted(points, key=lambda p: (p["temperature"], p["series"], p["value"])):
        cells = [_cell(p["tau"][d], p["stderr"][d]) for d in PANELS]
        lines.append(f"| {p['series']} | {p['value']} | {p['temperature']:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def tau_by_axis(runs: Sequence[Run], out: str | Path, axis: str | None = None) -> tuple[Path, str]:
    """The figure (a row per temperature, a panel per domain and their macro), its JSON beside it and a
    markdown table (returned and written as .md), as out/tau_by_<key>.png."""
    found = sweep_axis(runs, prefer=axis)
    if not found.key:
        raise AxisError("no config key differs across these runs: give runs that differ along one (axis=…)")
    points = tau_points(runs, found)
    if not points:
        raise AxisError("these runs have no evaluations: pass their evaluation folders too (results.json)")
    short = found.key.split(".")[-1]
    temps = sorted({p["temperature"] for p in points})
    families = list(dict.fromkeys(p["series"] for p in points))
    colors = dict(zip(families, plt.get_cmap("tab10").colors))
    values = sorted({p["value"] for p in points})
    levels = _levels(points)
    fig, axes = plt.subplots(len(temps), len(PANELS), figsize=(3.3 * len(PANELS), 2.9 * len(temps)))
    for row, t in zip(axes.reshape(len(temps), len(PANELS)), temps):
        for ax, domain in zip(row, PANELS):
            for fam in families:
                pts = sorted(
                    (p["value"], p["tau"][domain], p["stderr"][domain] or 0.0)
                    for p in points
                    if p["series"] == fam and p["temperature"] == t and p["tau"][domain] is not None
                )
                style = {"color": colors[fam], "linewidth": 1.6}
                if pts and fam in levels:  # the reference the others are read against
                    ax.axhline(pts[0][1], linestyle="--", label=f"{fam} ({short} {pts[0][0]})", **style)
                elif pts:
                    xs, ys, es = zip(*pts)
                    ax.errorbar(xs, ys, yerr=es, marker="o", markersize=4, capsize=2, label=fam, **style)
            ax.set_title(f"{domain}, T = {t:g}", fontsize=9)
            ax.set_xlabel(found.key)
            ax.set_xticks(values)
            ax.grid(alpha=0.3)
        row[0].set_ylabel("τ (macro)")
        row[0].legend(fontsize=7)
    pairs = paired_differences(points, levels)
    points = [{k: v for k, v in p.items() if k != "_totals"} for p in points]
    data = {"axis": found.key, "levels": levels, "points": points, "paired": pairs}
    path = save_figure(fig, Path(out) / f"tau_by_{short}.png", data)
    table = _markdown(points, found.key) + _paired_markdown(pairs, found.key)
    atomic_write_text(path.with_suffix(".md"), table)
    return path, table
