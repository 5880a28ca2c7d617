"""What the schedule stage writes into its FrontierFolder: frontier.json (points per policy and the
cost table they were priced with), the Fig. 7 frontier with the check whether hardware_aware's
points dominate every fixed-length policy's, the Fig. 8 budget plot, for measured points that
carry their rounds by drafted length (e2e) the cost check (fig_cost_check), and meta.json."""

from __future__ import annotations

import logging
import time

from omegaconf import DictConfig, OmegaConf

from ..artifacts import FrontierFolder
from ..core.provenance import provenance
from ..reporting.frontier_plots import budget_plot, cost_check_plot, frontier_plot
from ..scheduling.policies import Fixed, HardwareAware
from ..scheduling.replay import dominance

log = logging.getLogger(__name__)

FRONTIER_KEYS = ("concurrency", "throughput", "tps_per_user", "budget", "tau")


def write_outputs(
    cfg: DictConfig, folder: FrontierFolder, frontier: dict, policies: dict, cost, info: dict,
    started: float,
) -> dict:  # fmt: skip
    """Every file of the folder; returns what frontier.json holds."""
    points = {name: [{k: p[k] for k in FRONTIER_KEYS} for p in pts] for name, pts in frontier.items()}
    result = {"mode": str(cfg.mode), "cost_table": cost.to_dict(), "policies": points}
    folder.write_frontier(result)

    # Fixed lengths γ >= 1: fixed, fixed_<g>, mtp1 (γ = 0 is target-only decoding).
    fixed = [n for n, p in policies.items() if isinstance(p.base, Fixed) and p.base.gamma != 0]
    ha = next((n for n, p in policies.items() if isinstance(p.base, HardwareAware)), None)
    check = None
    if ha is not None and fixed:
        misses = dominance(points, ha, fixed)
        check = {
            "policy": ha,
            "against": fixed,
            "dominates": not misses,
            "not_dominated": misses,
            "definition": f"a point of another policy counts as dominated when some {ha} point has "
            "throughput and tok/s/user both >= it",
        }
        if misses:
            log.warning("%s does not dominate %d fixed-length points: %s", ha, len(misses), misses)
    synthetic = cost.meta.get("analytical") is not None
    tag = f"{cfg.mode}{' (synthetic roofline cost)' if synthetic else ''}"
    frontier_plot(
        points,
        folder.file("fig7_frontier.png"),
        title=f"Throughput vs interactivity — {tag}",
        data={
            "mode": str(cfg.mode),
            "x": "tps_per_user",
            "y": "throughput",
            "policies": points,
            "dominance": check,
            **info,
        },
    )
    budget_plot(
        points,
        folder.file("fig8_budget.png"),
        title=f"Throughput and budget vs concurrency — {tag}",
        data={
            "mode": str(cfg.mode),
            "x": "concurrency",
            "y": ["throughput", "budget"],
            "budget": "mean draft tokens verified per request per round (paper's Fig. 8 adds the anchor: +1)",
            "policies": points,
            **info,
        },
    )
    rounds = {
        name: [{k: p[k] for k in ("concurrency", "by_length")} for p in pts if p.get("by_length")]
        for name, pts in frontier.items()
    }
    if any(rounds.values()):
        cost_check_plot(
            rounds,
            folder.file("fig_cost_check.png"),
            title=f"Measured rounds against the cost table — {tag}",
            data={"mode": str(cfg.mode), "policies": rounds, **info},
        )
    folder.write_meta(
        {
            **provenance("dspark.schedule"),
            "wall_s": time.time() - started,
            **info,
            "config": OmegaConf.to_container(cfg, resolve=True),
        },
    )
    return result
