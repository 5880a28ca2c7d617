"""Evaluation figures: position-wise conditional acceptance (paper Fig. 2), the confidence
threshold sweep (Fig. 5) and the sequential head's latency (Fig. 4's rightmost panel). Each writes
a PNG and the JSON it plots beside it."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless nodes and CI
import matplotlib.pyplot as plt  # noqa: E402

from ..core.io import atomic_savefig, atomic_write_json, finite  # noqa: E402

__all__ = [
    "LEGEND_IN_PANEL",
    "acceptance_by_position_plot",
    "distinct_colors",
    "head_latency_plot",
    "save_figure",
    "threshold_sweep_plot",
    "write_json",
]


def write_json(path: str | os.PathLike, obj) -> Path:
    """Atomic strict-JSON write (NaN/inf become null; a reader never sees half a file)."""
    atomic_write_json(path, finite(obj))
    return Path(path)


def save_figure(fig, path: Path, data, dpi: int = 120, **savefig) -> Path:
    """``fig`` laid out and saved atomically at ``path`` (its folder made), then closed; ``data``, the
    numbers it draws, beside it as ``path.json``."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_savefig(fig, path, dpi=dpi, **savefig)
    plt.close(fig)
    write_json(path.with_suffix(".json"), data)
    return path


def distinct_colors(n: int) -> list:
    """n colours, all different: past tab20's twenty, a continuous map sampled evenly (a cycled
    palette would give two lines of one figure the same colour)."""
    if n <= 20:
        cmap = plt.get_cmap("tab10" if n <= 10 else "tab20")
        return [cmap(i) for i in range(n)]
    return [plt.get_cmap("turbo")(0.05 + 0.9 * i / (n - 1)) for i in range(n)]


def _panels(n: int, width: float = 3.6, height: float = 3.0, per_row: int = 4):
    """n panels, at most ``per_row`` to a row (a dashboard's seven stay readable); the unused
    cells of the last row are hidden."""
    cols = min(n, per_row)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)
    cells = list(axes.flat)
    for ax in cells[n:]:
        ax.set_visible(False)
    return fig, cells[:n]


LEGEND_IN_PANEL = 6  # more lines in a panel than this and a legend inside it covers them


def legend_beside(ax, handles: Sequence) -> None:
    """A crowded figure's one legend, right of ``ax`` and outside every panel (tight_layout makes
    room), a second column past 24 entries."""
    ax.legend(
        handles=list(handles),
        fontsize=7,
        loc="upper left",
        bbox_to_anchor=(1.02, 1.0),
        ncol=1 + len(handles) // 24,
    )


def acceptance_by_position_plot(
    curves: Mapping[str, Mapping[str, Sequence[float | None]]],
    path: str | os.PathLike,
    data: dict | None = None,
    per_row: int = 4,
) -> Path:
    """``curves[panel][label]`` = conditional acceptance at draft positions 1..γ (None = no data):
    one panel per domain, one line per drafter (or benchmark), as in Fig. 2, ``per_row`` panels to a
    row. Writes ``path`` and ``<stem>.json`` (``data`` if given, else the curves)."""
    path = Path(path)
    panels = list(curves)
    if not panels:
        raise ValueError("no acceptance curves to plot")
    fig, axes = _panels(len(panels), per_row=per_row)
    gamma = max(len(r) for panel in panels for r in curves[panel].values())
    labels = list(dict.fromkeys(label for panel in panels for label in curves[panel]))
    color = dict(zip(labels, distinct_colors(len(labels))))  # one colour a line across the panels
    crowded = max(len(curves[panel]) for panel in panels) > LEGEND_IN_PANEL
    for ax, panel in zip(axes, panels):
        for label, rates in curves[panel].items():
            pts = [(k + 1, r) for k, r in enumerate(rates) if r is not None]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o", markersize=4, linewidth=1.6, label=label, color=color[label])
        ax.set_title(panel.capitalize() if panel.islower() else panel)
        ax.set_xlim(0.5, gamma + 0.5)
        ax.set_xticks(range(1, gamma + 1))
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("Draft position")
        ax.grid(alpha=0.3)
        if not crowded:
            ax.legend(fontsize=7)
    if crowded:  # one legend beside the first row: in a panel it would hide the lines
        handles = [plt.Line2D([], [], color=color[lb], marker="o", markersize=4, label=lb) for lb in labels]
        legend_beside(axes[min(len(axes), per_row) - 1], handles)  # the first row's last panel
    axes[0].set_ylabel("Cond. acceptance")
    return save_figure(fig, path, data if data is not None else {"curves": curves})


def threshold_sweep_plot(
    sweep: Mapping[str, Sequence[Mapping]], path: str | os.PathLike, data: dict | None = None
) -> Path:
    """``sweep[panel]`` = rows with ``threshold``, ``accepted_per_step``, ``rejected_per_step`` and
    ``acceptance_rate``: stacked bars of verified draft tokens per step (accepted / rejected, hatched)
    and the acceptance rate on a twin axis, one panel per domain (Fig. 5)."""
    path = Path(path)
    panels = list(sweep)
    if not panels:
        raise ValueError("no threshold sweep to plot")
    fig, axes = _panels(len(panels), width=4.0)
    rate_axes = []
    for ax, panel in zip(axes, panels):
        rows = sweep[panel]
        xs = [r["threshold"] for r in rows]
        width = 0.8 * (min(b - a for a, b in zip(xs, xs[1:])) if len(xs) > 1 else 0.1)
        acc = [r["accepted_per_step"] for r in rows]
        rej = [r["rejected_per_step"] for r in rows]
        ax.bar(xs, acc, width=width, color="tab:blue", label="Accepted tokens")
        ax.bar(
            xs,
            rej,
            width=width,
            bottom=acc,
            color="white",
            edgecolor="tab:red",
            hatch="///",
            label="Rejected tokens",
        )
        ax.set_xlabel("Confidence threshold")
        ax.set_title(panel.capitalize() if panel.islower() else panel)
        rate_ax = ax.twinx()
        rate_axes.append(rate_ax)
        rates = [r["acceptance_rate"] for r in rows]
        pts = [(x, 100 * y) for x, y in zip(xs, rates) if y is not None]
        if pts:
            px, py = zip(*pts)
            rate_ax.plot(px, py, color="black", marker="o", markersize=3, label="Acceptance rate")
            for x, y in (pts[0], pts[-1]):
                rate_ax.annotate(
                    f"{y:.1f}%", (x, y), textcoords="offset points", xytext=(0, 5), fontsize=7, ha="center"
                )
        rate_ax.set_ylim(0, 105)
        rate_ax.set_ylabel("Acceptance rate (%)")
    axes[0].set_ylabel("Avg. tokens per step")
    bars, bar_labels = axes[0].get_legend_handles_labels()
    line, line_labels = rate_axes[0].get_legend_handles_labels()
    fig.legend(
        bars + line,
        bar_labels + line_labels,
        loc="lower center",
        bbox_to_anchor=(0.5, 1.0),
        ncol=3,
        fontsize=8,
        frameon=False,
    )
    return save_figure(fig, path, data if data is not None else {"sweep": sweep}, bbox_inches="tight")


def head_latency_plot(rows: Sequence[Mapping], path: str | os.PathLike, data: dict | None = None) -> Path:
    """``rows`` of ``python -m dspark.bench.head_latency`` (``label``, ``block_size``, ``rows``,
    ``round_ms``, ``sequential_head_ms``, ``head_share``): a column per row count R, a line per
    drafter against the block size; top the whole round's latency (Fig. 4's rightmost panel), then
    the sequential head's latency, then its share of the round (rows of ``mean_over_contexts``, which
    name their ``contexts``, say so in the titles). Writes ``path`` and
    ``<stem>.json`` (``data`` if given, else the rows)."""
    path = Path(path)
    counts = sorted({int(r["rows"]) for r in rows})
    if not counts:
        raise ValueError("no head-latency rows to plot")
    blocks = sorted({int(r["block_size"]) for r in rows})
    labels = list(dict.fromkeys(r["label"] for r in rows))
    panels = (("round_ms", 1.0, "Round latency (ms)"), ("sequential_head_ms", 1.0, "Sequential head (ms)"),
              ("head_share", 100.0, "Head share of round (%)"))  # fmt: skip
    fig, axes = plt.subplots(
        len(panels), len(counts), figsize=(3.6 * len(counts), 2.6 * len(panels)), squeeze=False
    )
    for j, r_count in enumerate(counts):
        for label in labels:
            pts = sorted(
                (r for r in rows if r["rows"] == r_count and r["label"] == label),
                key=lambda r: r["block_size"],
            )
            xs = [r["block_size"] for r in pts]
            for i, (key, scale, _) in enumerate(panels):
                ys = [scale * r[key] for r in pts]
                axes[i][j].plot(xs, ys, marker="o", markersize=4, linewidth=1.6, label=label)
        contexts = rows[0].get("contexts")  # mean_over_contexts' rows
        # a second line: on one, two columns' titles ran into each other
        span = f"\nmean over contexts {min(contexts)}-{max(contexts)}" if contexts else ""
        axes[0][j].set_title(f"R = {r_count}{span}", fontsize=10)
        axes[-1][j].set_xlabel("Block size")
        for ax in axes[:, j]:
            ax.set_xticks(blocks)
            ax.grid(alpha=0.3)
    for i, (_, _, name) in enumerate(panels):
        axes[i][0].set_ylabel(name)
    axes[0][0].legend(fontsize=7)
    return save_figure(fig, path, data if data is not None else {"rows": list(rows)})
