"""Reliability diagrams of cumulative prefix-survival predictions (DSpark Fig. 6)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: training nodes and CI have no display
import matplotlib.pyplot as plt  # noqa: E402

from ..core.io import atomic_savefig, atomic_write_json, finite  # noqa: E402

__all__ = ["reliability_diagram"]


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.1f}%"


def _curve(ax, bins: dict, **style) -> None:
    pts = [(p, y) for p, y in zip(bins["mean_pred"], bins["mean_label"]) if p is not None]
    if pts:
        xs, ys = zip(*pts)
        ax.plot(xs, ys, marker="o", markersize=3, linewidth=1.5, **style)


def reliability_diagram(
    per_position_data: Sequence[dict],
    path: str | os.PathLike,
    positions: Sequence[int] | None = None,
    title: str | None = None,
) -> Path:
    """Plot one panel per draft position: raw and STS reliability curves over the diagonal, with the
    per-bin sample counts as a shaded histogram on a twin axis. Writes ``path`` (PNG) and the plotted
    data as ``<stem>.json`` beside it; returns the PNG path.

    ``per_position_data``: entries as produced by ``metrics.reliability_data`` — ``position``,
    ``raw`` (and optionally ``sts``) bin dicts, plus ``ece_raw``/``ece_sts``/``auroc`` for the labels.
    ``positions`` (1-based) selects panels, e.g. ``[1, 3, 5, 7]`` as in the paper.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [finite(r) for r in per_position_data if positions is None or r["position"] in set(positions)]
    if not rows:
        raise ValueError("no positions to plot")

    ncols = min(len(rows), 4)
    nrows = -(-len(rows) // ncols)
    fig, axes = plt.subplots(
        nrows, ncols, figsize=(3.2 * ncols, 3.2 * nrows), squeeze=False, sharex=True, sharey=True
    )
    for ax, row in zip(axes.flat, rows):
        raw, sts = row["raw"], row.get("sts")
        # Histogram first, on a twin axis behind the curves, so it reads as background density.
        hx = ax.twinx()
        width = raw["centers"][1] - raw["centers"][0] if len(raw["centers"]) > 1 else 1.0
        hist = sts if sts is not None else raw  # STS is monotone per position; bins barely differ
        hx.bar(hist["centers"], hist["counts"], width=width, color="tab:gray", alpha=0.18, linewidth=0)
        hx.set_yticks([])
        ax.set_zorder(hx.get_zorder() + 1)
        ax.patch.set_visible(False)

        ax.plot([0, 1], [0, 1], linestyle="--", color="black", linewidth=1, label="Perfect calibration")
        _curve(ax, raw, color="tab:red", label="Before calibration")
        if sts is not None:
            _curve(ax, sts, color="tab:blue", label="After calibration")
        ece = f"ECE: {_pct(row.get('ece_raw'))}"
        if sts is not None:
            ece += f" \u2192 {_pct(row.get('ece_sts'))}"
        auc = row.get("auroc")
        text = ece + ("" if auc is None else f"\nAUC: {auc:.3f}") + f"\nn = {row.get('count', '?')}"
        ax.text(0.03, 0.97, text, transform=ax.transAxes, va="top", fontsize=8)
        ax.set_title(f"Position {row['position']}", fontsize=10)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
    for ax in axes.flat[len(rows) :]:
        ax.set_visible(False)
    for col in range(ncols):
        # The bottom panel of a column may be a hidden filler; label the lowest visible one instead.
        ax = [a for a in axes[:, col] if a.get_visible()][-1]
        ax.set_xlabel("Predicted acceptance")
        ax.xaxis.set_tick_params(labelbottom=True)
    for ax in axes[:, 0]:
        ax.set_ylabel("Observed acceptance")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.tight_layout()
    fig.legend(
        handles, labels, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3, fontsize=8, frameon=False
    )
    if title:
        fig.suptitle(title, y=1.0 + 0.12 / nrows, fontsize=11)
    atomic_savefig(fig, path, dpi=120, bbox_inches="tight")
    plt.close(fig)

    atomic_write_json(path.with_suffix(".json"), {"positions": rows})
    return path
