"""Assemble and run one training job from a composed config (the body of `python -m dspark.train`)."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar, TQDMProgressBar
from omegaconf import DictConfig, OmegaConf

from .callbacks import CalibrationCallback, DrafterExport, Throughput
from .drafters import TargetDims, build_drafter
from .module import DraftingModule
from .objectives import LossWeights
from .target import load_target

log = logging.getLogger(__name__)


def build_logger(
    cfg: DictConfig, out_dir: Path, run_name: str, full_cfg: DictConfig, resumed_at: int | None = None
):
    """Loggers for a run. A CSV log is always kept (`logs/metrics.csv`, what the dashboard reads);
    a resumed run logs into its own sub-folder (`logs/resumed-<step>/`) so nothing is overwritten."""
    name = cfg.name
    version = "" if resumed_at is None else f"resumed-{resumed_at}"
    csv_logger = L.pytorch.loggers.CSVLogger(out_dir, name="logs", version=version)
    if name == "csv":
        return [csv_logger]
    if name == "tensorboard":
        return [L.pytorch.loggers.TensorBoardLogger(out_dir, name="tb", version=version), csv_logger]
    if name == "wandb":
        try:
            import wandb  # noqa: F401
        except ImportError as err:
            raise ImportError("logger=wandb needs wandb: pip install 'dspark[wandb]'") from err
        # WANDB_MODE wins over the config; offline unless someone asks for online.
        mode = os.environ.get("WANDB_MODE") or cfg.get("mode") or "offline"
        logger = L.pytorch.loggers.WandbLogger(
            project=cfg.project,
            group=cfg.get("group"),
            tags=list(cfg.get("tags") or []),
            name=cfg.get("run_name") or run_name,
            save_dir=str(out_dir),
            mode=mode,
        )
        logger.log_hyperparams(OmegaConf.to_container(full_cfg, resolve=True))
        return [logger, csv_logger]
    raise ValueError(f"logger.name '{name}' is not one of csv, wandb, tensorboard")


def trainer_kwargs(cfg: DictConfig) -> dict:
    t = OmegaConf.to_container(cfg, resolve=True)
    keys = (
        "accelerator",
        "devices",
        "strategy",
        "num_nodes",
        "precision",
        "max_steps",
        "max_epochs",
        "val_check_interval",
        "limit_val_batches",
        "log_every_n_steps",
        "gradient_clip_val",
        "accumulate_grad_batches",
        "limit_train_batches",
        "check_val_every_n_epoch",
        "max_time",
    )
    nullable = {"check_val_every_n_epoch"}  # None is meaningful there: validate by global step
    return {k: t[k] for k in keys if k in t and (t[k] is not None or k in nullable)}


def run_training(cfg: DictConfig) -> dict:
    L.seed_everything(int(cfg.seed), workers=True)
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = load_target(cfg.target)

    from .data.cache import target_fingerprint
    from .data.datamodule import DraftDataModule
    from .prepare import ensure_dataset

    data_dir = ensure_dataset(cfg.data, cfg.target, target=target, features=cfg.features)
    datamodule = DraftDataModule(
        cfg.data,
        features=cfg.features,
        target_fingerprint=target_fingerprint(target),
        pad_token_id=target.tokenizer.pad_token_id,
    )

    drafter = build_drafter(TargetDims.of(target), cfg.drafter, cfg.get("head"))
    module = DraftingModule(
        target,
        drafter,
        LossWeights.from_cfg(cfg.loss),
        OmegaConf.to_container(cfg.optim),
        cfg.features,
        # Anchors per sequence: the data config may cap the paper's 512 for small CPU runs.
        num_anchors=cfg.data.get("anchors_per_sequence") or cfg.drafter.get("num_anchors"),
    )
    n_params = sum(p.numel() for p in drafter.parameters())
    log.info(
        "drafter %s (%s head): %.2fM trainable parameters", cfg.drafter.name, cfg.head.name, n_params / 1e6
    )

    throughput = Throughput()
    ckpt_dir = out_dir / "checkpoints"
    every = int(cfg.callbacks.checkpoint_every_n_steps)
    callbacks = [
        ModelCheckpoint(dirpath=ckpt_dir, save_last=True, every_n_train_steps=every, save_top_k=0),
        DrafterExport(out_dir / "drafter", cfg.drafter, cfg.get("head"), every),
        throughput,
        RichProgressBar() if os.isatty(1) else TQDMProgressBar(refresh_rate=10),
    ]
    if cfg.callbacks.get("calibration", True) and getattr(drafter, "confidence", None) is not None:
        callbacks.insert(0, CalibrationCallback())
    last = ckpt_dir / "last.ckpt"
    resume = last if cfg.resume and last.exists() else None
    resumed_at = None
    if resume:
        resumed_at = int(torch.load(resume, map_location="cpu", weights_only=True)["global_step"])
        log.info("resuming from %s (step %d)", resume, resumed_at)
    trainer = L.Trainer(
        **trainer_kwargs(cfg.trainer),
        logger=build_logger(cfg.logger, out_dir, cfg.run_name, cfg, resumed_at),
        callbacks=callbacks,
        default_root_dir=out_dir,
        enable_model_summary=False,
    )
    OmegaConf.save(cfg, out_dir / "config.yaml", resolve=True)
    start = time.perf_counter()
    trainer.fit(module, datamodule=datamodule, ckpt_path=resume)
    summary = {
        "run_name": cfg.run_name,
        "drafter": cfg.drafter.name,
        "head": cfg.head.name,
        "target": target.name,
        "global_step": int(trainer.global_step),
        "wall_seconds": time.perf_counter() - start,
        "trainable_parameters": n_params,
        "throughput": throughput.summary(),
        "final": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "data_dir": str(data_dir),
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if cfg.logger.name != "csv" and trainer.is_global_zero:
        from .reporting.dashboard import publish_run

        publish_run(trainer.loggers, out_dir)  # figures and tables to W&B / TensorBoard
    log.info("done: %s", json.dumps({k: summary[k] for k in ("global_step", "wall_seconds")}))
    return summary
