"""python -m dspark.schedule mode=analytical rounds=<evaluation folder | rounds.jsonl> cost_table=<json>|null
python -m dspark.schedule mode=measured drafter_dir=<checkpoint> target=<target> [cost_table=<json>]
python -m dspark.schedule mode=e2e e2e=<json of python -m dspark.bench.e2e> [e2e_temperature=<T>]

Sweeps concurrency R for each verification-length policy (dspark.frontier) and writes into out_dir
(dspark.artifacts.FrontierFolder): frontier.json ({"mode", "cost_table", "policies": {name:
[{"concurrency", "throughput", "tps_per_user", "budget", "tau"}]}}), fig7_frontier.png/.json
(throughput vs tok/s/user, with the check whether hardware_aware dominates every fixed γ),
fig8_budget.png/.json (throughput and verification budget vs R), meta.json, and in measured mode
cost_table.json.

Analytical mode replays recorded rounds; with cost_table=null it prices them on a SYNTHETIC roofline
(``analytical_cost``), which shows the shape of the trade-off but no real hardware. Measured mode
runs the engine; without a cost table it first profiles the target's verification step over token
batch sizes at ``context_len`` (and the drafter per R), which the load-aware policies then use. E2e
mode draws the frontier an end-to-end benchmark measured (target-only and each policy per R).
"""

from __future__ import annotations

import logging
import time

import hydra
from omegaconf import DictConfig

from .cli import launch, user_errors

log = logging.getLogger(__name__)


def run(cfg: DictConfig) -> dict:
    from .artifacts import FrontierFolder
    from .config import check_schedule
    from .frontier import run_analytical, run_e2e, run_measured, write_outputs

    check_schedule(cfg)
    started = time.time()
    with FrontierFolder(str(cfg.out_dir)).claimed("out_dir") as folder:
        if cfg.mode == "analytical":
            frontier, policies, cost, info = run_analytical(cfg)
        elif cfg.mode == "e2e":
            frontier, policies, cost, info = run_e2e(cfg)
        else:
            frontier, policies, cost, info = run_measured(cfg, folder)
        result = write_outputs(cfg, folder, frontier, policies, cost, info, started)
    for name, pts in result["policies"].items():
        points = [f"R={p['concurrency']}: {p['throughput']:.0f} tok/s, τ={p['tau']:.2f}" for p in pts]
        log.info("%-16s %s", name, "  ".join(points))
    log.info("frontier in %s", folder.path)
    return result


@hydra.main(version_base="1.3", config_path="pkg://dspark.conf", config_name="schedule")
def main(cfg: DictConfig) -> None:
    with user_errors():
        run(cfg)


if __name__ == "__main__":
    launch(main)
