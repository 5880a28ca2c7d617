"""Serving figures: the throughput / interactivity frontier (paper Fig. 7), throughput and
verification budget against concurrency (Fig. 8), and the measured rounds against the cost table's
price of them (the scheduler's model, checked). Each writes a PNG and the JSON it plots."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path

from .plots import plt, save_figure

__all__ = ["budget_plot", "cost_check_plot", "frontier_plot"]


def _finite(xs):
    return [x for x in xs if isinstance(x, (int, float)) and math.isfinite(x) and x > 0]


def _log_if_wide(ax, axis: str, values, ratio: float = 20.0) -> None:
    # Concurrency sweeps span decades on the interactivity axis; a linear axis would squash the
    # high-concurrency points into a corner. Narrow ranges stay linear and readable.
    v = _finite(values)
    if v and max(v) / min(v) >= ratio:
        (ax.set_xscale if axis == "x" else ax.set_yscale)("log")


def _series(points, key):
    return [p[key] for p in points]


# Load-aware policies coincide wherever the cost curve leaves one best budget (e.g. a pure
# roofline), so every curve gets its own marker and dash to stay visible under another.
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
_DASHES = ("-", "--", "-.", ":")


def _style(i: int) -> dict:
    return {"marker": _MARKERS[i % len(_MARKERS)], "ls": _DASHES[i % len(_DASHES)], "ms": 4, "lw": 1.4}


def frontier_plot(
    policies: Mapping[str, list[dict]], path: str | os.PathLike, title: str = "", data: dict | None = None
) -> Path:
    """Aggregate throughput vs tok/s/user, one curve per policy, points labelled with R."""
    path = Path(path)
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    xs, ys = [], []
    for i, (name, pts) in enumerate(policies.items()):
        x, y = _series(pts, "tps_per_user"), _series(pts, "throughput")
        xs += x
        ys += y
        (line,) = ax.plot(x, y, label=name, **_style(i))
        for p in (pts[0], pts[-1]) if pts else ():
            ax.annotate(
                f"R={p['concurrency']}",
                (p["tps_per_user"], p["throughput"]),
                fontsize=6,
                color=line.get_color(),
                xytext=(3, 3),
                textcoords="offset points",
            )
    _log_if_wide(ax, "x", xs)
    _log_if_wide(ax, "y", ys)
    ax.set_xlabel("per-user speed (tok/s/user)")
    ax.set_ylabel("aggregate throughput (tok/s)")
    ax.set_title(title or "Throughput vs interactivity", fontsize=9, wrap=True)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    return save_figure(fig, path, data if data is not None else {"policies": dict(policies)}, dpi=150)


def budget_plot(
    policies: Mapping[str, list[dict]], path: str | os.PathLike, title: str = "", data: dict | None = None
) -> Path:
    """Two panels against concurrency R: aggregate throughput, and mean draft tokens verified per
    request per round (the paper's budget counts the anchor as well: ours + 1)."""
    path = Path(path)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6.4, 6.0), sharex=True)
    rs = []
    for i, (name, pts) in enumerate(policies.items()):
        r = _series(pts, "concurrency")
        rs += r
        top.plot(r, _series(pts, "throughput"), label=name, **_style(i))
        bottom.plot(r, _series(pts, "budget"), label=name, **_style(i))
    if _finite(rs) and max(_finite(rs)) / min(_finite(rs)) >= 4:
        bottom.set_xscale("log", base=2)
    top.set_ylabel("aggregate throughput (tok/s)")
    bottom.set_ylabel("verified draft tokens / request")
    bottom.set_xlabel("concurrent requests R")
    bottom.set_ylim(bottom=0)
    top.set_ylim(bottom=0)
    top.set_title(title or "Load-adaptive throughput and verification budget", fontsize=9, wrap=True)
    for ax in (top, bottom):
        ax.grid(True, which="both", alpha=0.3)
    top.legend(fontsize=7)
    return save_figure(fig, path, data if data is not None else {"policies": dict(policies)}, dpi=150)


def cost_check_plot(
    policies: Mapping[str, list[dict]], path: str | os.PathLike, title: str = "", data: dict | None = None
) -> Path:
    """The rounds an e2e run measured against the cost table's price of them, from each point's
    ``by_length`` (per rows bucket and drafted length; marker area grows with the rounds): measured
    against priced ms, on the diagonal where the table was right, and their ratio by drafted length,
    where a bias that separates plain rounds (0) from drafting ones shows as a slope."""
    path = Path(path)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10.0, 4.4))
    priced = {name: [g for p in pts for g in p.get("by_length") or () if g.get("priced_ms")]
              for name, pts in policies.items()}  # fmt: skip
    most = max((g["rounds"] for mine in priced.values() for g in mine), default=1)
    xs = []
    for i, (name, mine) in enumerate(priced.items()):
        if not mine:
            continue
        size = [8 + 60 * g["rounds"] / most for g in mine]
        style = {"marker": _MARKERS[i % len(_MARKERS)], "s": size, "alpha": 0.7, "label": name}
        left.scatter([g["priced_ms"] for g in mine], [g["ms"] for g in mine], **style)
        right.scatter([g["drafted"] for g in mine], [g["ms"] / g["priced_ms"] for g in mine], **style)
        xs += [g["priced_ms"] for g in mine] + [g["ms"] for g in mine]
    if _finite(xs):
        lo, hi = min(_finite(xs)), max(_finite(xs))
        left.plot([lo, hi], [lo, hi], color="grey", lw=1, ls="--")
    right.axhline(1.0, color="grey", lw=1, ls="--")
    left.set_xlabel("priced round (ms, cost table at the engine's rows)")
    left.set_ylabel("measured round (ms, device timeline)")
    right.set_xlabel("drafted positions γ_d (0: plain round)")
    right.set_ylabel("measured / priced")
    fig.suptitle(title or "Measured rounds against the cost table", fontsize=9, wrap=True)
    for ax in (left, right):
        ax.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=7)
    return save_figure(fig, path, data if data is not None else {"policies": dict(policies)}, dpi=150)
