"""The paper's evaluation figures across the drafters of a Table-1 batch, from their evaluation
folders, each PNG with the JSON it plots beside it:

    fig2_acceptance_T<t>.png          Fig. 2, one per temperature: position-wise conditional
                                      acceptance, a panel per domain (the mean over its
                                      benchmarks, as the paper averages), a line per drafter
    fig5_threshold_<label>_T<t>.png   Fig. 5, per drafter with a confidence head: tokens per step
                                      and acceptance rate against the confidence threshold
    fig6_reliability_<label>_T<t>.png Fig. 6, per evaluation run with calibrate=true: reliability
                                      per position before / after STS, ECE and AUROC

Figs. 5 and 6 are redrawn from the JSON each evaluation wrote beside its own figure (only the JSON
has to travel); Fig. 2 from results.json. ``calibration_markdown`` is the ECE / AUROC table that
goes with Fig. 6.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from ..artifacts import EvaluationFolder
from ..calibration.plots import reliability_diagram
from ..core.io import atomic_write_text
from ..data.benchmarks import DOMAINS
from .labelled import Labelled, read_labelled
from .plots import acceptance_by_position_plot, threshold_sweep_plot
from .tables import DOMAIN_ORDER

__all__ = [
    "acceptance_figures",
    "calibration_markdown",
    "domain_acceptance",
    "paper_figures",
    "reliability_figures",
    "threshold_figures",
]


def _t(temperature: float) -> str:
    return f"T{temperature:g}"


def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else None


def domain_acceptance(results: dict, domains: dict[str, str] | None = None) -> dict[str, list[float | None]]:
    """domain -> conditional acceptance per position, the mean over the domain's benchmarks (a
    position no round of a benchmark reached is left out of that position's mean), domains in
    the paper's order; ``domains`` maps benchmark -> domain (default: the project's, a benchmark it
    does not know is a domain of its own)."""
    domains = DOMAINS if domains is None else domains
    by_domain: dict[str, list[list]] = {}
    for name, b in results["benchmarks"].items():
        by_domain.setdefault(domains.get(name, name), []).append(b.get("accept_rate_by_position") or [])
    order = sorted(by_domain, key=lambda d: DOMAIN_ORDER.index(d) if d in DOMAIN_ORDER else len(DOMAIN_ORDER))
    out = {}
    for dom in order:
        rates = by_domain[dom]
        out[dom] = [_mean([r[k] for r in rates if k < len(r)]) for k in range(max(map(len, rates)))]
    return out


def acceptance_figures(rows: Sequence[Labelled], out: Path) -> list[Path]:
    """Fig. 2 per temperature, every drafter evaluated at it."""
    paths = []
    for temp in sorted({r.temperature for r in rows}):
        at = [r for r in rows if r.temperature == temp]
        curves: dict[str, dict[str, list]] = {}
        for r in at:
            for dom, rates in domain_acceptance(r.results).items():
                curves.setdefault(dom, {})[r.label] = rates
        data = {
            "temperature": temp,
            "definition": "P(position k accepted | positions 1..k-1 accepted), over rounds that verified "
            "position k; a domain's curve is the mean over its benchmarks",
            "domains": curves,
            "benchmarks": {
                r.label: {n: b.get("accept_rate_by_position") for n, b in r.results["benchmarks"].items()}
                for r in at
            },
            "sources": {r.label: str(r.path) for r in at},
        }
        paths.append(acceptance_by_position_plot(curves, out / f"fig2_acceptance_{_t(temp)}.png", data=data))
    return paths


def threshold_figures(rows: Sequence[Labelled], out: Path) -> list[Path]:
    """Fig. 5 of every evaluation whose drafter has a confidence head."""
    paths = []
    for r in rows:
        data = EvaluationFolder(r.path).read_figure_data(EvaluationFolder.THRESHOLD_FIGURE)
        if data is None:
            continue  # no confidence head: evaluate draws no threshold sweep
        path = out / f"fig5_threshold_{r.label}_{_t(r.temperature)}.png"
        data = {**data, "label": r.label, "temperature": r.temperature, "source": str(r.path)}
        paths.append(threshold_sweep_plot(data["sweep"], path, data=data))
    return paths


def reliability_figures(rows: Sequence[Labelled], out: Path) -> list[Path]:
    """Fig. 6 of every evaluation run with calibrate=true."""
    paths = []
    for r in rows:
        data = EvaluationFolder(r.path).read_figure_data(EvaluationFolder.RELIABILITY_FIGURE)
        if data is None:
            continue
        path = out / f"fig6_reliability_{r.label}_{_t(r.temperature)}.png"
        title = f"{r.label}, T = {r.temperature:g}: prefix survival on held-out benchmark rounds"
        paths.append(reliability_diagram(data["positions"], path, title=title))
    return paths


def _pct(v) -> str:
    return "–" if v is None else f"{100 * v:.2f} %"


def calibration_markdown(rows: Sequence[Labelled]) -> str:
    """ECE raw → after STS and AUROC per evaluation run with calibrate=true: the means over
    positions and the worst position (the issue's goals: ECE ≤ 1 % per position, AUROC ≥ 0.8)."""
    header = ["Drafter", "T", "ECE raw (mean)", "ECE STS (mean)", "ECE STS (worst position)"]
    header += ["AUROC (mean)", "AUROC (lowest)"]
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    for r in rows:
        cal = r.evaluation.calibration
        if not cal or not cal.get("per_position"):
            continue
        per = cal["per_position"]
        worst_ece = max((p["ece_sts"] for p in per if p.get("ece_sts") is not None), default=None)
        lowest_auc = min((p["auroc"] for p in per if p.get("auroc") is not None), default=None)
        cells = [r.label, f"{r.temperature:g}", _pct(cal.get("ece_raw_mean")), _pct(cal.get("ece_sts_mean"))]
        cells += [_pct(worst_ece), _fmt(cal.get("auroc_mean")), _fmt(lowest_auc)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n" if len(lines) > 2 else ""


def _fmt(v) -> str:
    return "–" if v is None else f"{v:.3f}"


def paper_figures(sources: Sequence[str], out: str | Path) -> Path:
    """Figs. 2, 5 and 6 of the evaluation folders ``sources`` (``label:folder`` or folders) into
    ``out``, and ``out/figures.md``: what was drawn (and why a figure is missing) and the
    calibration table. Returns the markdown's path."""
    rows, out = read_labelled(sources), Path(out)
    drawn = acceptance_figures(rows, out)
    fig5, fig6 = threshold_figures(rows, out), reliability_figures(rows, out)
    lines = ["# Figures 2, 5, 6\n"]
    lines += [f"- {p.name} (+ {p.with_suffix('.json').name})" for p in [*drawn, *fig5, *fig6]]
    if not fig5:
        lines.append("- no Fig. 5: no drafter here has a confidence head")
    if not fig6:
        lines.append("- no Fig. 6: no evaluation here ran with calibrate=true")
    table = calibration_markdown(rows)
    text = "\n".join(lines) + "\n" + (f"\n## Calibration (Fig. 6)\n\n{table}" if table else "")
    return atomic_write_text(out / "figures.md", text)
