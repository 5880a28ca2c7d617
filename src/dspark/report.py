"""python -m dspark.report runs=<folder or glob> [axis=<config key>] [logger=wandb|tensorboard]
python -m dspark.report mode=table1 runs=[Label:<eval folder>,…] [table1=<json>] [split_gamma=true]
python -m dspark.report mode=figures runs=[Label:<eval folder>,…]
python -m dspark.report mode=head_latency runs=<head_latency.json>   # or runs=[<a.json>,<b.json>]
python -m dspark.report mode=tau_by_axis runs=[<run and evaluation folders>] [axis=<config key>]

Static ablation dashboard from run folders (training runs, evaluation folders, multirun dirs):
index.html with τ per benchmark, position-wise acceptance, ECE raw vs after STS, loss curves and
the sweep axis, plus PNG figures and markdown tables. See docs/sweeps.md.

mode=table1: the paper's Table 1 from evaluation folders (dspark.reporting.table1): table1.json
(τ ± standard error per benchmark, macro averages by domain, one table per temperature) and its
markdown, printed. mode=figures: Figs. 2, 5 and 6 across those drafters into out_dir
(dspark.reporting.paper_figures), each PNG with its JSON, and figures.md, printed.
mode=head_latency: Fig. 4's latency panel from ``python -m dspark.bench.head_latency``'s JSON (or
several, each a part of the grid that compares: dspark.reporting.head_latency) into
out_dir/fig4_latency.png (+ its JSON). mode=tau_by_axis: τ by domain along the key that differs across
the runs (or axis=), a line per drafter family (dspark.reporting.axis_figure): Fig. 3 over a depth
sweep, Fig. 4's τ panel over a block-size sweep; out_dir/tau_by_<key>.png with its JSON and markdown."""

from __future__ import annotations

import logging
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from .cli import launch, user_errors

log = logging.getLogger(__name__)


def run_report(cfg: DictConfig) -> Path:
    from .config import check_report
    from .reporting.dashboard import build_dashboard, publish
    from .reporting.runs import find_runs

    check_report(cfg)
    spec = OmegaConf.to_container(cfg.runs) if OmegaConf.is_list(cfg.runs) else str(cfg.runs)
    if cfg.get("mode") == "table1":
        return _table1(cfg, spec)
    if cfg.get("mode") == "figures":
        return _figures(cfg, spec)
    if cfg.get("mode") == "head_latency":
        return _head_latency(cfg, spec)
    runs = find_runs(spec)
    if not runs:
        raise FileNotFoundError(
            f"runs={spec}: no run folder (config.yaml) or evaluation (results.json) found"
        )
    if cfg.get("mode") == "tau_by_axis":
        return _tau_by_axis(cfg, runs)
    out = Path(cfg.out_dir)
    index = build_dashboard(runs, out, title=cfg.title, axis=cfg.get("axis"), source=f"runs={spec}")
    log.info("dashboard of %d runs: %s", len(runs), index)
    if cfg.get("logger") is not None and cfg.logger.name != "csv":
        # The logger's own run (offline by default for W&B) gets the dashboard's figures and tables.
        from lightning.pytorch.loggers import WandbLogger

        from .training import build_logger

        built = build_logger(cfg.logger, out, cfg.title, cfg)
        loggers = built if isinstance(built, list) else [built]  # build_logger may add the CSV logger
        figures = sorted((out / "figures").glob("*.png"))
        tables = {p.stem: p.read_text(encoding="utf-8") for p in sorted((out / "tables").glob("*.md"))}
        publish(loggers, figures, tables)
        for lg in loggers:
            if isinstance(lg, WandbLogger):
                lg.experiment.finish()  # flush now: the report process may live on (tests, notebooks)
    return index


def _sources(spec) -> list[str]:
    return [spec] if isinstance(spec, str) else [str(s) for s in spec]


def _table1(cfg: DictConfig, spec) -> Path:
    from .reporting.table1 import gather_table1

    path = Path(cfg.table1) if cfg.get("table1") else Path(cfg.out_dir) / "table1.json"
    print(gather_table1(_sources(spec), path, bool(cfg.split_gamma)))
    return path


def _figures(cfg: DictConfig, spec) -> Path:
    from .reporting.paper_figures import paper_figures

    index = paper_figures(_sources(spec), Path(cfg.out_dir))
    print(index.read_text(encoding="utf-8"))
    return index


def _head_latency(cfg: DictConfig, spec) -> Path:
    from .reporting.head_latency import head_latency_rows
    from .reporting.plots import head_latency_plot

    rows, data = head_latency_rows(_sources(spec))  # several: one session's part of the grid each
    path = head_latency_plot(rows, Path(cfg.out_dir) / "fig4_latency.png", data=data)
    print(path)
    return path


def _tau_by_axis(cfg: DictConfig, runs) -> Path:
    from .reporting.axis_figure import tau_by_axis

    path, table = tau_by_axis(runs, Path(cfg.out_dir), axis=cfg.get("axis"))
    print(table)
    print(path)
    return path


@hydra.main(version_base="1.3", config_path="pkg://dspark.conf", config_name="report")
def main(cfg: DictConfig) -> None:
    with user_errors():  # an unknown axis= (reporting.runs.AxisError) is a ConfigError too
        out = run_report(cfg)
        if cfg.get("mode", "dashboard") == "dashboard":
            print(out)


if __name__ == "__main__":
    launch(main)
