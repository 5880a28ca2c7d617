"""The paper's Table 1 gathered from evaluation folders (one per drafter and temperature):
``docs/results/table1.json`` and its markdown, τ ± standard error.

One table per temperature (per temperature and γ with ``split_gamma``, for a block-size sweep):

    {"target", "temperature", "gamma",
     "rows":   {drafter: {benchmark: τ, …, "macro": {"math", "code", "chat", "all"}}},
     "stderr": {drafter: {benchmark: SE, …, "macro": {…}}},
     "prompts": {drafter: {benchmark: requests}}, "sources": {drafter: folder},
     "findings": [{"row", "baseline", "ratio", "stderr", "stderr_kind", "goal", "met"}],
     "differences": [{"row", "baseline", "difference", "stderr", "stderr_kind", "z"}],
     "position_differences": [{"row", "baseline", "difference": [per k], "stderr": [per k]}]}

``findings``: the paper's claims about these rows, each DSpark row's macro τ over each baseline row's
(DFlash: ≥ 1.10×, Eagle3: ≥ 1.25×; ``PAPER_GOALS``) with its standard error. ``differences``: each
row's macro τ (all benchmarks) minus each earlier row's, its standard error and their quotient ``z``:
whether two rows differ by more than prompt sampling explains. ``position_differences``: the same
pairs position by position, Fig. 2's conditional acceptance at draft position k (the mean over all
benchmarks), paired (``request_positions`` in results.json; rows without them are left out).

The errors are the evaluation's own (``tau_stderr``, ``macro_stderr`` in results.json: the ratio
estimator's standard error over prompts, ``decoding.uncertainty``); folders written before they
were recorded give null. Two rows evaluated on the same prompts are compared **paired**
(``stderr_kind: "paired"``, ``decoding.uncertainty.paired_comparison`` over each request's totals,
``request_totals`` in results.json): the prompts' difficulty is common to both and cancels. Folders
written before the totals were recorded, or rows whose prompts differ, fall back to adding the
rows' errors as independent (``"independent"``), which overstates the error of a comparison.

The rows of one table must compare: one target, a fixed policy (Table 1 verifies whole blocks, no
confidence scheduling), one γ, the same benchmarks.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Sequence
from pathlib import Path

from ..core.errors import DataError
from ..core.io import atomic_write_json, atomic_write_text, finite
from ..data.benchmarks import DOMAINS
from ..decoding.uncertainty import paired_comparison
from .labelled import Labelled, read_labelled
from .tables import table1

__all__ = [
    "PAPER_GOALS", "build_tables", "differences", "findings", "gather_table1", "paired_comparisons",
    "table_markdown", "write_table1",
]  # fmt: skip

# The paper's Table 1 claims: DSpark's macro τ at least this many times the baseline's (by drafter kind).
PAPER_GOALS = {"dflash": 1.10, "eagle3": 1.25}


def _check_comparable(rows: Sequence[Labelled]) -> None:
    targets = {}
    for row in rows:
        targets.setdefault(row.results["target"], []).append(row)
    if len(targets) > 1:
        which = "; ".join(f"{t}: {', '.join(str(r.path) for r in rs)}" for t, rs in targets.items())
        raise DataError(
            f"the evaluations are of different targets ({which}): Table 1 compares drafters on one "
            f"target, gather each target's folders separately"
        )
    for row in rows:
        policy = row.results.get("policy") or {}
        name = policy.get("name") if isinstance(policy, dict) else policy
        if name not in (None, "fixed"):
            raise DataError(
                f"{row.path} was evaluated with policy={name}: Table 1 verifies fixed blocks; "
                f"evaluate it again with policy=fixed"
            )
        if row.gamma is None:
            raise DataError(f"{row.path}: its results say neither γ nor the position-wise acceptance")


def _group(rows: Sequence[Labelled], split_gamma: bool) -> dict[tuple, list[Labelled]]:
    groups: dict[tuple, list[Labelled]] = {}
    for row in rows:
        key = (row.temperature, row.gamma) if split_gamma else (row.temperature,)
        groups.setdefault(key, []).append(row)
    return dict(sorted(groups.items()))


def _check_table(rows: Sequence[Labelled]) -> None:
    t = rows[0].temperature
    gammas = {r.gamma for r in rows}
    if len(gammas) > 1:
        which = ", ".join(f"{r.label} γ={r.gamma} ({r.path})" for r in rows)
        raise DataError(
            f"γ differs between the rows at T={t:g}: {which}. Table 1 compares drafters at one block: "
            f"evaluate them with the same policy.gamma, or pass split_gamma=true for a block-size "
            f"sweep (one table per γ)"
        )
    seen: dict[str, Labelled] = {}
    for r in rows:
        if r.label in seen:
            raise DataError(
                f"two evaluations at T={t:g} are labelled {r.label} ({seen[r.label].path}, {r.path}): "
                f"name each row, runs=[name:folder,…]"
            )
        seen[r.label] = r
    first = rows[0]
    for r in rows[1:]:
        if set(r.results["benchmarks"]) != set(first.results["benchmarks"]):
            raise DataError(
                f"{r.label} ({r.path}) was evaluated on {sorted(r.results['benchmarks'])}, {first.label} "
                f"({first.path}) on {sorted(first.results['benchmarks'])}: evaluate every row on the same "
                f"benchmarks (benchmarks=[…]) so that the macro averages compare"
            )


def _table(rows: Sequence[Labelled]) -> dict:
    first = rows[0]
    table: dict = {
        "target": first.results["target"],
        "temperature": first.temperature,
        "gamma": first.gamma,
        "rows": {},
        "stderr": {},
        "prompts": {},
        "sources": {},
    }
    for r in rows:
        bench = r.results["benchmarks"]
        table["rows"][r.label] = {n: b.get("tau") for n, b in bench.items()}
        table["rows"][r.label]["macro"] = dict(r.results.get("macro") or {})
        table["stderr"][r.label] = {n: b.get("tau_stderr") for n, b in bench.items()}
        table["stderr"][r.label]["macro"] = dict(r.results.get("macro_stderr") or {})
        table["prompts"][r.label] = {n: b.get("requests") for n, b in bench.items()}
        table["sources"][r.label] = str(r.path)
    paired = paired_comparisons(rows)
    table["findings"] = findings(table, {r.label: str(r.results.get("drafter", "")) for r in rows}, paired)
    table["differences"] = differences(table, paired)
    table["position_differences"] = position_differences(rows)
    return table


def paired_comparisons(rows: Sequence[Labelled]) -> dict[tuple[str, str], dict]:
    """(row, baseline) -> ``paired_comparison`` of their macro τ, for every ordered pair of rows whose
    results carry each request's totals for the same benchmarks and prompts."""
    totals = {}
    for r in rows:
        per = {n: b.get("request_totals") for n, b in r.results["benchmarks"].items()}
        if all(t is not None for t in per.values()):
            totals[r.label] = per
    out = {}
    for row, a in totals.items():
        for base, b in totals.items():
            if row != base:
                with contextlib.suppress(ValueError):  # prompts that do not pair: independent errors
                    out[row, base] = paired_comparison(a, b)
    return out


def position_differences(rows: Sequence[Labelled]) -> list[dict]:
    """Each row's conditional acceptance at each draft position minus each earlier row's (the mean over
    the benchmarks), with its paired standard error: for rows whose results carry each request's
    counts by position (``request_positions``) on the same prompts; None at a position some
    benchmark's rounds never reached."""
    counts = {}
    for r in rows:
        per = {n: b.get("request_positions") for n, b in r.results["benchmarks"].items()}
        if all(c is not None for c in per.values()):
            counts[r.label] = per
    labels = [r.label for r in rows if r.label in counts]
    gamma = rows[0].gamma
    out = []
    for j, row in enumerate(labels):
        for base in labels[:j]:
            diff, err = [], []
            for k in range(gamma):
                a, b = (_at_position(counts[label], k) for label in (row, base))
                try:
                    c = paired_comparison(a, b)
                except ValueError:  # other prompts, or a position no round of a benchmark reached
                    c = {"difference": None, "difference_stderr": None}
                diff.append(c["difference"])
                err.append(c["difference_stderr"])
            if any(d is not None for d in diff):
                out.append({"row": row, "baseline": base, "difference": diff, "stderr": err})
    return out


def _at_position(per_benchmark: dict, k: int) -> dict:
    """benchmark -> request -> (rounds that accepted position k, rounds that reached it)."""
    return {
        n: {q: (acc[k], reached[k]) for q, (acc, reached) in per.items()} for n, per in per_benchmark.items()
    }


def _macro(table: dict, key: str, label: str) -> float | None:
    return ((table[key].get(label) or {}).get("macro") or {}).get("all")


def findings(table: dict, kinds: dict[str, str], paired: dict | None = None) -> list[dict]:
    """Each DSpark row (``kinds``: label -> the results' drafter, ``dspark-markov``, …) against each
    row of a ``PAPER_GOALS`` kind: the ratio of their macro τ over all benchmarks ± its standard error
    (``paired``'s where the pair has one, else by the delta method over the two rows' errors), the
    paper's goal and whether the ratio reaches it."""
    paired = paired or {}
    out = []
    for row, kind in kinds.items():
        if not kind.startswith("dspark"):
            continue
        for base, base_kind in kinds.items():
            a, b = _macro(table, "rows", row), _macro(table, "rows", base)
            if base_kind not in PAPER_GOALS or a is None or not b:
                continue
            ratio = a / b
            if (row, base) in paired:
                se, how = paired[row, base]["ratio_stderr"], "paired"
            else:
                se_a, se_b = _macro(table, "stderr", row), _macro(table, "stderr", base)
                se = None if se_a is None or se_b is None else ratio * math.hypot(se_a / a, se_b / b)
                how = "independent"
            goal = PAPER_GOALS[base_kind]
            out.append({"row": row, "baseline": base, "ratio": ratio, "stderr": se, "stderr_kind": how,
                        "goal": goal, "met": ratio >= goal})  # fmt: skip
    return out


def differences(table: dict, paired: dict | None = None) -> list[dict]:
    """Each row's macro τ over all benchmarks minus each earlier row's, with its standard error
    (paired where ``paired`` has the pair, else the two rows' errors added as independent) and
    ``z`` = difference / error."""
    paired = paired or {}
    labels = list(table["rows"])
    out = []
    for j, row in enumerate(labels):
        for base in labels[:j]:
            a, b = _macro(table, "rows", row), _macro(table, "rows", base)
            if a is None or b is None:
                continue
            if (row, base) in paired:
                se, how = paired[row, base]["difference_stderr"], "paired"
            else:
                se_a, se_b = _macro(table, "stderr", row), _macro(table, "stderr", base)
                se = None if se_a is None or se_b is None else math.hypot(se_a, se_b)
                how = "independent"
            z = (a - b) / se if se else None
            out.append({"row": row, "baseline": base, "difference": a - b, "stderr": se,
                        "stderr_kind": how, "z": z})  # fmt: skip
    return out


def build_tables(rows: Sequence[Labelled], split_gamma: bool = False) -> list[dict]:
    """Table 1 per temperature (and γ with ``split_gamma``), ascending, rows in the order given;
    a DataError naming the folders and the fix when the rows do not compare."""
    if not rows:
        raise DataError("no evaluation to gather into Table 1")
    _check_comparable(rows)
    tables = []
    for group in _group(rows, split_gamma).values():
        _check_table(group)
        tables.append(_table(group))
    return tables


def _as_results(table: dict, label: str) -> dict:
    """One row of ``table`` in results.json's shape, the layout ``tables.table1`` prints."""
    vals, errs = table["rows"][label], table["stderr"].get(label, {})
    names = [n for n in vals if n != "macro"]
    return {
        "target": table["target"],
        "drafter": label,
        "temperature": table["temperature"],
        "benchmarks": {n: {"tau": vals[n], "tau_stderr": errs.get(n)} for n in names},
        "macro": vals.get("macro") or {},
        "macro_stderr": errs.get("macro") or {},
    }


def table_markdown(table: dict) -> str:
    """The table in the paper's layout, τ ± standard error, with its temperature, γ and prompts."""
    labels = list(table["rows"])
    body = table1([_as_results(table, label) for label in labels], DOMAINS)
    counts = {tuple(sorted((table.get("prompts") or {}).get(label, {}).items())) for label in labels}
    if len(counts) == 1:
        per = ", ".join(f"{n} {c}" for n, c in next(iter(counts)) if c is not None)
        prompts = f"prompts per benchmark: {per}" if per else "prompts per benchmark: not recorded"
    else:
        prompts = "prompts per benchmark differ between rows (see `prompts` in the JSON)"
    head = f"**T = {table['temperature']:g}, γ = {table['gamma']}**, target {table['target']}; {prompts}.\n\n"
    text = head + body
    claims = [
        f"- {f['row']} / {f['baseline']}: {f['ratio']:.3f}{_error(f)}"
        f" (the paper: ≥ {f['goal']:.2f}×, {'met' if f['met'] else 'not met'})"
        for f in table.get("findings") or []
    ]
    if claims:
        text += "\n\nThe paper's claims, macro τ over all benchmarks:\n\n" + "\n".join(claims) + "\n"
    diffs = [
        f"- {d['row']} − {d['baseline']}: {d['difference']:+.3f}{_error(d)}"
        + (f", {abs(d['z']):.1f} standard errors" if d["z"] is not None else "")
        for d in table.get("differences") or []
    ]
    if diffs:
        text += "\n\nDifferences between rows, macro τ over all benchmarks:\n\n" + "\n".join(diffs) + "\n"
    if table.get("position_differences"):
        text += "\n\n" + _position_markdown(table["position_differences"], table["gamma"])
    return text


def _position_markdown(pairs: Sequence[dict], gamma: int) -> str:
    """``position_differences`` as a table: a pair per line, difference ± paired SE per position."""

    def cell(d, se):
        return "–" if d is None else f"{d:+.3f}" + ("" if se is None else f" ± {se:.3f}")

    head = "| row − baseline | " + " | ".join(f"k = {k + 1}" for k in range(gamma)) + " |"
    lines = [head, "|---|" + "---:|" * gamma]
    for p in pairs:
        cells = " | ".join(cell(d, se) for d, se in zip(p["difference"], p["stderr"]))
        lines.append(f"| {p['row']} − {p['baseline']} | {cells} |")
    return (
        "Differences by draft position: conditional acceptance at position k (Fig. 2), the mean over all "
        "benchmarks, ± paired standard error:\n\n" + "\n".join(lines) + "\n"
    )


def _error(entry: dict) -> str:
    """`` ± SE (paired)`` or `` ± SE (independent)``; nothing when the error is unknown."""
    if entry["stderr"] is None:
        return ""
    return f" ± {entry['stderr']:.3f} ({entry.get('stderr_kind', 'independent')})"


def write_table1(tables: Sequence[dict], path: str | os.PathLike) -> Path:
    """The tables as strict JSON, atomically: one object for one table, else a list."""
    path = Path(path)
    atomic_write_json(path, finite(tables[0] if len(tables) == 1 else list(tables)))
    return path


def gather_table1(sources: Sequence[str], path: str | os.PathLike, split_gamma: bool = False) -> str:
    """Table 1 of the evaluation folders ``sources`` (``label:folder`` or folders): the JSON at
    ``path``, its markdown beside it (``.md``); returns the markdown."""
    tables = build_tables(read_labelled(sources), split_gamma)
    path = write_table1(tables, path)
    markdown = "\n".join(table_markdown(t) for t in tables)
    atomic_write_text(path.with_suffix(".md"), markdown)
    return markdown
