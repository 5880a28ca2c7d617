"""Static ablation dashboard: index.html + PNG figures + markdown tables comparing runs.

    out_dir/index.html        one page, sections: runs, sweep, tau, acceptance, calibration, loss
    out_dir/report.md         the same tables and figure links as markdown (README / issue ready)
    out_dir/figures/*.png     (+ the JSON each plot was drawn from)
    out_dir/tables/*.md
    out_dir/dashboard.json    every number shown, for scripts

Nothing here needs a network or a logger; `publish` optionally pushes the figures and tables to
Lightning loggers (W&B images/tables, TensorBoard images/text).
"""

from __future__ import annotations

import contextlib
import html
import json
import math
import os
import re
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless nodes and CI
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from ..artifacts import RunFolder  # noqa: E402
from ..core.io import atomic_savefig, atomic_write_text  # noqa: E402
from .axis_figure import paired_table  # noqa: E402
from .paper_figures import domain_acceptance  # noqa: E402
from .plots import (  # noqa: E402
    LEGEND_IN_PANEL,
    acceptance_by_position_plot,
    distinct_colors,
    legend_beside,
    write_json,
)
from .runs import Run, SweepAxis, is_numeric, label_runs, read_run, sweep_axis  # noqa: E402
from .tables import DOMAIN_ORDER, table1  # noqa: E402

__all__ = ["SECTIONS", "build_dashboard", "publish", "publish_run"]

SECTIONS = {
    "runs": "Runs",
    "sweep": "Sweep axis",
    "tau": "τ per benchmark",
    "acceptance": "Position-wise acceptance",
    "calibration": "Calibration: ECE raw vs after STS",
    "loss": "Loss curves",
}


def _domains(results: dict) -> dict[str, str]:
    from ..data.benchmarks import DOMAINS

    return {**DOMAINS, **(results.get("domains") or {})}


def _fmt(v, digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def md_table(header: Sequence[str], rows: Sequence[Sequence]) -> str:
    def cell(v) -> str:
        return _fmt(v).replace("|", "\\|")

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _save(fig, path: Path) -> Path:
    for ax in fig.axes:  # "1e-6 + 1.0051" offsets hide the values a reader compares
        with contextlib.suppress(AttributeError):  # log or categorical axes have no offset
            ax.ticklabel_format(axis="y", useOffset=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=110)
    plt.close(fig)
    return path


def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else None


def _val_acceptance(run: Run) -> list[float | None]:
    """Teacher-forced per-position acceptance from validation: c*_k = 1 - TV(p_d, p_t) at position k."""
    out, k = [], 1
    while run.final(f"val/c_star_{k}") is not None or run.final(f"val/c_star_{k + 1}") is not None:
        out.append(run.final(f"val/c_star_{k}"))
        k += 1
    return out


def _eval_rows(runs: Sequence[Run]) -> list[tuple[Run, object, str]]:
    """(run, evaluation, label) for every evaluation; the tag joins the label only when evaluations
    of the runs differ in policy / temperature."""
    tags = {ev.tag for r in runs for ev in r.evaluations}
    return [
        (r, ev, f"{r.label} [{ev.tag}]" if len(tags) > 1 else r.label) for r in runs for ev in r.evaluations
    ]


# ----------------------------------------------------------------------------------------------
# sections: each returns (figures, tables, notes)


def _short(text: str, n: int = 60) -> str:
    # Multirun job folders are named after every override: keep both ends, readable in a table.
    return text if len(text) <= n else f"{text[: n // 2 - 1]}…{text[-(n // 2) :]}"


def _section_runs(runs, axis: SweepAxis, out: Path):
    root = Path(os.path.commonpath([str(r.path) for r in runs]))
    if len(runs) == 1:
        root = root.parent
    header = [
        "run",
        "drafter",
        "head",
        "rank",
        "γ",
        "layers",
        "target",
        "steps",
        "params (M)",
        "wall (s)",
        "val/loss",
        "val/tau_prob",
        "val ECE raw",
        "val ECE STS",
        "evals",
        "folder",
    ]
    rows = []
    for r in runs:
        f = r.flat
        params = r.summary.get("trainable_parameters")
        rows.append(
            [
                r.label,
                f.get("drafter.name"),
                f.get("head.name"),
                f.get("head.rank"),
                f.get("drafter.block_size"),
                f.get("drafter.num_layers"),
                f.get("target.name"),
                r.summary.get("global_step"),
                params / 1e6 if params else None,
                r.summary.get("wall_seconds"),
                r.final("val/loss"),
                r.final("val/tau_prob"),
                r.final("val/ece_raw_mean"),
                r.final("val/ece_sts_mean"),
                len(r.evaluations),
                _short(os.path.relpath(r.path, root)),
            ]
        )
    notes = [f"Folders relative to `{root}`."]
    if axis.key:
        extra = f"; lines split by {', '.join(axis.series)}" if axis.series else ""
        notes.append(f"Sweep axis: `{axis.key}` (the config key that differs across runs{extra}).")
    elif len(runs) > 1:
        notes.append("The runs share every experimental config key: no sweep axis.")
    return [], {"runs": md_table(header, rows)}, notes


def _series(runs: Sequence[Run], axis: SweepAxis) -> dict[str, list[Run]]:
    groups: dict[str, list[Run]] = {}
    for r in axis.order(runs):
        groups.setdefault(axis.series_label(r) or "runs", []).append(r)
    return groups


def _section_sweep(runs, axis: SweepAxis, out: Path):
    if not axis.key:
        return [], {}, ["No config key differs across these runs, so there is no sweep axis to plot."]
    ordered = axis.order(runs)
    values = [axis.value(r) for r in ordered]
    numeric = is_numeric(values)
    cats = list(dict.fromkeys(values))
    pos = sorted(v for v in set(values) if numeric and v > 0)
    if len(pos) >= 3 and all(b >= 1.9 * a for a, b in zip(pos, pos[1:])):
        numeric, cats = False, sorted(set(values))  # doubling grids (ranks 0, 32 … 512): even spacing

    def x_of(r):
        return axis.value(r) if numeric else cats.index(axis.value(r))

    groups = _series(runs, axis)
    colors = dict(zip(groups, distinct_colors(len(groups))))
    evals = _eval_rows(runs)
    tags = sorted({ev.tag for _, ev, _ in evals})
    panels = []
    if evals:
        panels.append(("τ (evaluation, macro over benchmarks)", "eval"))
    panels += [
        ("val/tau_prob (expected τ, training)", "val/tau_prob"),
        ("ECE, mean over positions", "ece"),
        ("val/loss (end of training)", "val/loss"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.0 * len(panels), 3.3), squeeze=False)
    for ax, (title, what) in zip(axes[0], panels):
        for name, members in groups.items():
            c = colors[name]
            lab = None if name == "runs" else name
            if what == "eval":
                for j, tag in enumerate(tags):
                    pts = [
                        (x_of(r), ev.results.get("macro", {}).get("all"))
                        for r in members
                        for ev in r.evaluations
                        if ev.tag == tag
                    ]
                    _line(
                        ax,
                        pts,
                        color=c,
                        marker="os^v"[j % 4],
                        label=" ".join(x for x in (lab, tag if len(tags) > 1 else None) if x),
                    )
            elif what == "ece":
                _line(
                    ax,
                    [(x_of(r), _cal_mean(r, "ece_raw")) for r in members],
                    color=c,
                    label=f"{lab or ''} raw".strip(),
                )
                _line(
                    ax,
                    [(x_of(r), _cal_mean(r, "ece_sts")) for r in members],
                    color=c,
                    linestyle="--",
                    marker="s",
                    label=f"{lab or ''} after STS".strip(),
                )
            else:
                _line(ax, [(x_of(r), r.final(what)) for r in members], color=c, label=lab)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(axis.key)
        if not numeric:
            ax.set_xticks(range(len(cats)), [str(c) for c in cats])
        elif len(set(values)) <= 8:
            ax.set_xticks(sorted(set(values)))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[1]:
            ax.legend(fontsize=7)
    fig_path = _save(fig, out / "figures" / "sweep_axis.png")

    header = [
        axis.key,
        *(["series"] if axis.series else []),
        "val/tau_prob",
        "val/loss",
        "ECE raw",
        "ECE STS",
    ]
    header += [f"τ {d}" for d in (*DOMAIN_ORDER, "all")] if evals else []
    rows = []
    for r in ordered:
        row = [
            axis.value(r),
            *([axis.series_label(r)] if axis.series else []),
            r.final("val/tau_prob"),
            r.final("val/loss"),
            _cal_mean(r, "ece_raw"),
            _cal_mean(r, "ece_sts"),
        ]
        if evals:
            macro = r.evaluations[0].results.get("macro", {}) if r.evaluations else {}
            row += [macro.get(d) for d in (*DOMAIN_ORDER, "all")]
        rows.append(row)
    tables = {"sweep": md_table(header, rows)}
    if paired := paired_table(runs, axis):  # which differences along the sweep exceed prompt noise
        tables["paired"] = paired
    return [fig_path], tables, []


def _line(ax, pts, **style):
    pts = [(x, y) for x, y in pts if y is not None and math.isfinite(y)]
    if pts:
        xs, ys = zip(*pts)
        style.setdefault("marker", "o")
        style.setdefault("markersize", 4)
        ax.plot(xs, ys, linewidth=1.6, **style)


def _legend(axes) -> None:
    """Each run once: inside the first panel while it holds at most LEGEND_IN_PANEL lines, else
    beside the last panel, where it covers none of them."""
    found: dict = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            found.setdefault(label, handle)
    if len(found) <= LEGEND_IN_PANEL:
        axes[0].legend(list(found.values()), list(found), fontsize=7)
    else:
        legend_beside(axes[-1], list(found.values()))


def _domain_rank(domain: str) -> int:
    return DOMAIN_ORDER.index(domain) if domain in DOMAIN_ORDER else len(DOMAIN_ORDER)


def _cal_mean(run: Run, key: str) -> float | None:
    cal = run.calibration_summary()
    if cal is None:
        return None
    v = cal.get(f"{key}_mean")
    if v is not None and math.isfinite(v):
        return float(v)
    return _mean([p.get(key) for p in cal["per_position"]])


def _section_tau(runs, axis, out: Path):
    evals = _eval_rows(runs)
    if not evals:
        return (
            [],
            {},
            [
                "No evaluation found next to these runs: `python -m dspark.evaluate "
                "drafter_dir=<run>/drafter hydra.run.dir=<run>/eval` fills this section."
            ],
        )
    results = [{**ev.results, "drafter": label} for _, ev, label in evals]
    domains: dict[str, str] = {}
    for res in results:
        domains.update(_domains(res))
    table = table1(results, domains)
    names = list(dict.fromkeys(n for res in results for n in res["benchmarks"]))
    names.sort(key=lambda n: _domain_rank(domains.get(n, "")))
    cols = names + ["macro all"]
    panels = tau_panels(evals)
    runs_drawn = list({id(r): r for _, rows in panels for r, _ in rows}.values())  # Run is unhashable
    color = {id(r): c for r, c in zip(runs_drawn, distinct_colors(len(runs_drawn)))}
    widest = max(len(rows) for _, rows in panels)
    fig, axes = plt.subplots(
        len(panels),
        1,
        figsize=(max(5.0, 1.1 * len(cols) + 0.25 * widest), 0.6 + 2.9 * len(panels)),
        sharex=True,
        squeeze=False,
    )
    for ax, (tag, rows) in zip(axes[:, 0], panels):
        width = 0.8 / len(rows)
        for i, (run, ev) in enumerate(rows):
            res = ev.results
            ys = [res["benchmarks"].get(n, {}).get("tau") for n in names] + [res.get("macro", {}).get("all")]
            xs = [j + (i - (len(rows) - 1) / 2) * width for j in range(len(cols))]
            ax.bar(
                [x for x, y in zip(xs, ys) if y is not None],
                [y for y in ys if y is not None],
                width=width,
                color=color[id(run)],
            )
        if len(panels) > 1:
            ax.set_title(tag, fontsize=9)
        ax.set_ylabel("τ (accepted + 1)")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.grid(axis="y", alpha=0.3)
    axes[-1, 0].set_xticks(range(len(cols)), cols, rotation=20, fontsize=8)
    # one entry a run, beside the bars so none is covered
    legend_beside(axes[0, 0], [Patch(color=color[id(r)], label=r.label) for r in runs_drawn])
    return [_save(fig, out / "figures" / "tau_by_benchmark.png")], {"tau": table}, []


def tau_panels(evals) -> list[tuple[str, list]]:
    """The τ figure's panels: one per evaluation tag (policy, γ, temperature), in first-seen order,
    each with its (run, evaluation) bars; a run keeps one colour across the panels, so the legend
    names runs and the panel titles name the tags (eleven runs at two temperatures were 22 bars a
    group and a legend taller than the figure)."""
    panels: dict[str, list] = {}
    for run, ev, _ in evals:
        panels.setdefault(ev.tag, []).append((run, ev))
    return list(panels.items())


def _section_acceptance(runs, axis, out: Path):
    curves: dict[str, dict[str, list]] = {}
    evals = _eval_rows(runs)
    tags = list(dict.fromkeys(ev.tag for _, ev, _ in evals))
    by_tag = len(tags) > 1  # then a row of panels per tag, a line per run (one colour across rows)
    found = []
    for run, ev, label in evals:
        for dom, rates in domain_acceptance(ev.results, _domains(ev.results)).items():
            found.append(
                (tags.index(ev.tag), _domain_rank(dom), dom, ev.tag, run.label if by_tag else label, rates)
            )
    for _, _, dom, tag, label, rates in sorted(found, key=lambda f: f[:2]):  # stable: runs keep their order
        curves.setdefault(f"{dom.capitalize()}, {tag}" if by_tag else dom, {})[label] = rates
    domains_shown = len({f[2] for f in found}) or 1
    val_panel = "Validation c*ₖ (teacher-forced)"
    for r in runs:
        acc = _val_acceptance(r)
        if any(a is not None for a in acc):
            curves.setdefault(val_panel, {})[r.label] = acc
    if not curves:
        return (
            [],
            {},
            ["No position-wise acceptance: neither evaluations nor val/c_star_k metrics were found."],
        )
    path = acceptance_by_position_plot(
        curves, out / "figures" / "acceptance_by_position.png", per_row=domains_shown if by_tag else 4
    )
    gamma = max(len(v) for panel in curves.values() for v in panel.values())
    rows = [
        [panel, label, *(list(v) + [None] * (gamma - len(v)))]
        for panel, per in curves.items()
        for label, v in per.items()
    ]
    table = md_table(["panel", "run", *[f"k={k + 1}" for k in range(gamma)]], rows)
    note = (
        "Evaluation panels: conditional acceptance of draft position k given positions < k were "
        "accepted (mean over the domain's benchmarks). Validation panel: c*ₖ = 1 − TV(p_d, p_t) "
        "with the true previous tokens."
    )
    return [path], {"acceptance": table}, [note]


def _calibration_params(cal: dict) -> str:
    """Each position's T, with STS with offsets its offset b after it: ``T (b)``."""
    temps = cal.get("temperatures") or [p.get("temperature") for p in cal["per_position"]]
    offsets = cal.get("offsets") or [None] * len(temps)
    return " ".join(_fmt(t, 2) + ("" if b is None else f" ({b:+.2f})") for t, b in zip(temps, offsets))


def _section_calibration(runs, axis, out: Path):
    cals = [(r, r.calibration_summary()) for r in runs]
    cals = [(r, c) for r, c in cals if c is not None]
    if not cals:
        return (
            [],
            {},
            [
                "No calibration report: drafters without a confidence head (DFlash, Eagle3, "
                "head-less runs without `drafter.confidence.enabled`) have none."
            ],
        )
    fig, axes = plt.subplots(1, 2, figsize=(8.4, 3.3), sharey=True)
    for (r, cal), color in zip(cals, distinct_colors(len(cals))):
        pp = cal["per_position"]
        ks = [p.get("position", i + 1) for i, p in enumerate(pp)]
        for ax, key in zip(axes, ("ece_raw", "ece_sts")):
            _line(ax, list(zip(ks, [p.get(key) for p in pp])), color=color, label=r.label)
    for ax, title in zip(axes, ("ECE raw (confidence head)", "ECE after STS")):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("Draft position")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("ECE of Π σ(z_i / T_i)")
    _legend(list(axes))
    path = _save(fig, out / "figures" / "calibration.png")
    rows = [
        [
            r.label,
            cal.get("source"),
            _cal_mean(r, "ece_raw"),
            _cal_mean(r, "ece_sts"),
            _mean([p.get("auroc") for p in cal["per_position"]]),
            _calibration_params(cal),
        ]
        for r, cal in cals
    ]
    header = ["run", "measured on", "ECE raw", "ECE after STS", "AUROC", "STS temperatures (offsets)"]
    table = md_table(header, rows)
    return [path], {"calibration": table}, []


LOSS_PANELS = (
    ("train/loss", "train/loss"),
    ("val/loss", "val/loss"),
    ("val/tau_prob", "val/tau_prob"),
    ("lr-AdamW", "learning rate"),
)


def _section_loss(runs, axis, out: Path):
    panels = [(k, t) for k, t in LOSS_PANELS if any(r.curves.get(k) for r in runs)]
    if not panels:
        return (
            [],
            {},
            [
                "No metric history: loss curves come from logs/metrics.csv (logger=csv) or tb/ "
                "(logger=tensorboard)."
            ],
        )
    fig, axes = plt.subplots(1, len(panels), figsize=(4.0 * len(panels), 3.2), squeeze=False)
    for r, color in zip(runs, distinct_colors(len(runs))):
        for ax, (key, _) in zip(axes[0], panels):
            pts = r.curves.get(key) or []
            _line(ax, pts, color=color, label=r.label, marker="o" if len(pts) < 20 else "", markersize=3)
    for ax, (_, title) in zip(axes[0], panels):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(nbins=5, integer=True))  # steps run to 5 digits
        ax.grid(alpha=0.3)
    _legend(list(axes[0]))
    rows = [
        [
            r.label,
            r.summary.get("global_step"),
            r.final("train/loss"),
            r.final("val/loss"),
            r.final("val/tau_prob"),
            r.late_rise("val/tau_prob"),
            (r.summary.get("throughput") or {}).get("tokens_per_s"),
        ]
        for r in runs
    ]
    # The rise per 1 000 steps between the last two validations: how far from converged a run stopped.
    rise = "val/tau_prob rise /1k steps"
    table = md_table(["run", "steps", "train/loss", "val/loss", "val/tau_prob", rise, "tokens/s"], rows)
    # The plotted points beside the figure, so the numbers behind it can be read back.
    write_json(
        out / "figures" / "loss_curves.json", {r.label: {k: r.curves.get(k) for k, _ in panels} for r in runs}
    )
    return [_save(fig, out / "figures" / "loss_curves.png")], {"loss": table}, []


BUILDERS = {
    "runs": _section_runs,
    "sweep": _section_sweep,
    "tau": _section_tau,
    "acceptance": _section_acceptance,
    "calibration": _section_calibration,
    "loss": _section_loss,
}


# ----------------------------------------------------------------------------------------------
# page


def _inline(s: str) -> str:
    s = html.escape(s)
    s = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", s)
    return re.sub(r"`(.+?)`", r"<code>\1</code>", s)


def md_to_html(md: str) -> str:
    """The markdown this module writes (pipe tables, paragraphs, **bold**, `code`) as HTML."""
    inline = _inline
    out, table = [], []

    def flush():
        if table:
            head, body = table[0], [r for r in table[2:]]
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", head.strip().strip("|"))]
            out.append(
                "<table><thead><tr>"
                + "".join(f"<th>{inline(c)}</th>" for c in cells)
                + "</tr></thead><tbody>"
            )
            for row in body:
                vals = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", row.strip()[1:-1])]
                out.append("<tr>" + "".join(f"<td>{inline(v)}</td>" for v in vals) + "</tr>")
            out.append("</tbody></table>")
            table.clear()

    for line in md.splitlines():
        if line.startswith("|"):
            table.append(line)
            continue
        flush()
        if line.strip():
            out.append(f"<p>{inline(line.strip())}</p>")
    flush()
    return "\n".join(out)


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px auto;
max-width:1400px;color:#222;padding:0 16px}h1{margin-bottom:4px}.meta{color:#666;font-size:13px}
nav a{margin-right:14px}
section{border-top:1px solid #ddd;margin-top:26px;padding-top:6px}img{max-width:100%;border:1px solid #eee}
table{border-collapse:collapse;font-size:12.5px;margin:10px 0}th,td{border:1px solid #ddd;padding:3px 7px;
text-align:right;white-space:nowrap}th{background:#f4f4f4}td:first-child,th:first-child{text-align:left}
td:last-child{white-space:normal;overflow-wrap:anywhere;max-width:340px}
code{background:#f4f4f4;padding:0 3px}p{font-size:14px}.empty{color:#a60}
"""


def build_dashboard(
    runs: Sequence[Run],
    out_dir: str | os.PathLike,
    title: str = "dspark ablations",
    axis: str | None = None,
    source: str = "",
) -> Path:
    """Write the dashboard for `runs` into `out_dir`; returns the path of index.html."""
    if not runs:
        raise ValueError("no runs to report")
    out = Path(out_dir)
    (out / "tables").mkdir(parents=True, exist_ok=True)
    sw = sweep_axis(runs, axis)
    label_runs(runs, sw)
    runs = sw.order(runs)

    parts, md_parts, data = [], [f"# {title}\n"], {"axis": sw.key, "series": sw.series, "runs": []}
    for r in runs:
        data["runs"].append(
            {
                "label": r.label,
                "path": str(r.path),
                "axis_value": sw.value(r),
                "summary": r.summary,
                "calibration": r.calibration_summary(),
                "evaluations": [
                    {"path": str(e.path), "tag": e.tag, "results": e.results} for e in r.evaluations
                ],
            }
        )
    for key, heading in SECTIONS.items():
        figures, tables, notes = BUILDERS[key](runs, sw, out)
        body = [f'<section id="{key}"><h2>{html.escape(heading)}</h2>']
        md_parts.append(f"## {heading}\n")
        for note in notes:
            cls = ' class="empty"' if not figures and not tables else ""
            body.append(f"<p{cls}>{_inline(note)}</p>")
            md_parts.append(note + "\n")
        for fig in figures:
            rel = fig.relative_to(out).as_posix()
            body.append(f'<p><img src="{rel}" alt="{key}"></p>')
            md_parts.append(f"![{key}]({rel})\n")
        for name, md in tables.items():
            atomic_write_text(out / "tables" / f"{name}.md", md)
            body.append(md_to_html(md))
            body.append(f'<p class="meta"><a href="tables/{name}.md">tables/{name}.md</a></p>')
            md_parts.append(md)
        body.append("</section>")
        parts.append("\n".join(body))
        data.setdefault("sections", {})[key] = {
            "figures": [str(f.relative_to(out)) for f in figures],
            "tables": list(tables),
            "notes": notes,
        }

    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    nav = " ".join(f'<a href="#{k}">{html.escape(v)}</a>' for k, v in SECTIONS.items())
    axis_txt = f" · sweep axis <code>{html.escape(sw.key)}</code>" if sw.key else ""
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>"
        f"<div class='meta'>{len(runs)} runs{axis_txt} · {html.escape(source)} · built {stamp}</div>"
        f"<nav>{nav}</nav>\n" + "\n".join(parts) + "\n</body></html>\n"
    )
    index = out / "index.html"
    atomic_write_text(index, page)
    atomic_write_text(out / "report.md", "\n".join(md_parts))
    write_json(out / "dashboard.json", json.loads(json.dumps(data, default=str)))
    return index


# ----------------------------------------------------------------------------------------------
# loggers


def _md_rows(md: str) -> tuple[list[str], list[list[str]]]:
    lines = [ln for ln in md.splitlines() if ln.startswith("|")]
    split = [[c.strip() for c in re.split(r"(?<!\\)\|", ln.strip()[1:-1])] for ln in lines]
    return (split[0], split[2:]) if split else ([], [])


def publish(loggers, figures: Sequence[Path], tables: dict[str, str], prefix: str = "report") -> None:
    """Send figures and markdown tables to Lightning loggers: W&B as images and tables, TensorBoard
    as images and (markdown) text; the CSV logger has no place for them, the run folder keeps them."""
    from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger

    for lg in loggers or []:
        if isinstance(lg, WandbLogger):
            for fig in figures:
                lg.log_image(key=f"{prefix}/{fig.stem}", images=[str(fig)])
            for name, md in tables.items():
                columns, rows = _md_rows(md)
                if columns:
                    lg.log_table(key=f"{prefix}/{name}", columns=columns, data=rows)
        elif isinstance(lg, TensorBoardLogger):
            import matplotlib.image as mpimg

            for fig in figures:
                lg.experiment.add_image(f"{prefix}/{fig.stem}", mpimg.imread(fig)[..., :3], dataformats="HWC")
            for name, md in tables.items():
                lg.experiment.add_text(f"{prefix}/{name}", md)
            lg.experiment.flush()


def publish_run(loggers, run_dir: str | os.PathLike) -> Path:
    """A one-run dashboard in <run>/report (loss curves, position-wise c*, calibration) whose figures
    and tables also go to the run's W&B / TensorBoard logger. Call after fit and summary.json."""
    run = read_run(Path(run_dir))
    index = build_dashboard([run], RunFolder(run_dir).report, title=run.name, source=str(run_dir))
    out = index.parent
    figures = sorted((out / "figures").glob("*.png"))
    tables = {p.stem: p.read_text(encoding="utf-8") for p in sorted((out / "tables").glob("*.md"))}
    publish(loggers, figures, tables, prefix="run")
    return index
