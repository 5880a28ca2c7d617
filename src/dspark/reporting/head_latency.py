"""Fig. 4's latency panel from one or more JSONs of ``python -m dspark.bench.head_latency``.

A session may measure part of the grid (blocks 4 and 7 one day, 10 and 16 the next): their rows
join into one panel only where they compare, the same GPU, PyTorch, target, dtype, compilation,
drafter depth, contexts and draft vocabulary; anything else is refused by name before a figure is
drawn. Joined rows relate to DFlash's at the same block size and R whichever part measured it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..core.errors import ConfigError
from ..core.io import read_json

__all__ = ["COMPARABLE", "head_latency_rows"]

# What two measurements must share for their points to sit on one panel.
COMPARABLE = (
    "machine.accelerator", "machine.torch", "target", "dtype", "compiled", "layers", "contexts",
    "draft_vocab",
)  # fmt: skip


def _get(report: dict, key: str):
    value = report
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _relate_to_dflash(rows: list[dict]) -> None:
    """``round_vs_dflash`` as the bench defines it (the round over DFlash's at the same block size,
    R and context, or over the means of DFlash's, minus 1), for every row whose DFlash counterpart
    any of the joined parts measured."""
    where = ("block_size", "rows", "context")  # a mean has no "context": None matches None
    dflash = {tuple(r.get(k) for k in where): r["round_ms"] for r in rows if r["family"] == "dflash"}
    for r in rows:
        ref = dflash.get(tuple(r.get(k) for k in where))
        if ref:
            r["round_vs_dflash"] = r["round_ms"] / ref - 1.0


def _rows(report: dict) -> list[dict]:
    return report.get("mean_over_contexts") or report["results"]  # several contexts: their means


def head_latency_rows(paths: Sequence[str | Path]) -> tuple[list[dict], dict]:
    """The panel's rows (each report's ``mean_over_contexts``, else its ``results``) and the data
    written beside the figure: one report as it is, several as their sources and joined rows."""
    paths = [Path(p) for p in paths]
    missing = [str(p) for p in paths if not p.is_file()]
    if not paths or missing:
        raise ConfigError(
            f"mode=head_latency reads JSONs of python -m dspark.bench.head_latency, got {missing or 'none'}: "
            "runs=<head_latency.json> or runs=[<a.json>,<b.json>]"
        )
    reports = [read_json(p) for p in paths]
    for path, report in zip(paths, reports):
        if not isinstance(report, dict) or "results" not in report:
            raise ConfigError(f"{path} is no JSON of python -m dspark.bench.head_latency (no 'results')")
    if len(reports) == 1:
        report = reports[0]
        return _rows(report), report
    first = reports[0]
    for path, report in zip(paths[1:], reports[1:]):
        for key in COMPARABLE:
            if _get(report, key) != _get(first, key):
                raise ConfigError(
                    f"{paths[0]} and {path} differ in {key} ({_get(first, key)!r} against "
                    f"{_get(report, key)!r}): their latencies do not compare; draw them apart"
                )
    rows, seen = [], {}
    for path, report in zip(paths, reports):
        for row in _rows(report):
            point = (row["label"], row["block_size"], row["rows"])
            if point in seen:
                raise ConfigError(
                    f"{row['label']} at block {row['block_size']}, R = {row['rows']} is in both "
                    f"{seen[point]} and {path}: give each configuration once"
                )
            seen[point] = path
            rows.append(row)
    _relate_to_dflash(rows)  # a part without DFlash (one family measured again) relates to another's
    data = {
        "sources": [
            {"path": str(p), **{k: r.get(k) for k in ("command", "commit", "date", "machine")}}
            for p, r in zip(paths, reports)
        ],
        **{key: _get(first, key) for key in COMPARABLE if "." not in key},
        "rows": rows,
    }
    return rows, data
