"""Assemble and run one training job from a composed config (the body of `python -m dspark.train`)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint, RichProgressBar, TQDMProgressBar
from omegaconf import DictConfig, OmegaConf

from .artifacts import RunFolder
from .callbacks import CalibrationCallback, DrafterExport, Throughput
from .checkpoints import read_drafter_config, warm_start
from .core.errors import ConfigError, DataError
from .core.lock import folder_lock
from .core.threads import cap_cpu_threads
from .core.types import TargetDims
from .drafters import build_drafter
from .module import DraftingModule
from .objectives import LossWeights
from .resume import AtomicCheckpointIO, GracefulStop, Interrupted, resume_point
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


class BatchConfigError(ConfigError):
    """The batch arithmetic (data.batch_size, data.global_batch_size, devices, accumulation) does not fit."""


def world_size(trainer_cfg) -> int:
    """Processes a trainer config asks for: devices per node × num_nodes. `devices` may be an int,
    a list of device ids, a comma string ("0,1"), or "auto"/-1 (every visible GPU; 1 on CPU)."""
    devices = trainer_cfg.get("devices", 1)
    accelerator = str(trainer_cfg.get("accelerator", "auto"))
    if devices in ("auto", -1, "-1", None):
        gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
        n = torch.cuda.device_count() if gpu else 1
        if n < 1:
            raise BatchConfigError(f"trainer.devices={devices} but no GPU is visible (trainer.accelerator)")
    elif isinstance(devices, str):
        n = len([d for d in devices.split(",") if d.strip()]) if "," in devices else int(devices)
    elif isinstance(devices, int):
        n = devices
    else:
        n = len(list(devices))
    return max(1, n) * int(trainer_cfg.get("num_nodes", 1) or 1)


def resolve_batch(data_cfg, trainer_cfg) -> dict:
    """Per-device batch, world size, gradient accumulation and global batch, consistent.

    data.global_batch_size (samples per optimizer step) fixes accumulation as
    global / (data.batch_size × devices × num_nodes); null keeps trainer.accumulate_grad_batches and
    the global batch follows from it. Raises naming the keys when the numbers do not fit."""
    per_device = int(data_cfg.batch_size)
    if per_device < 1:
        raise BatchConfigError(f"data.batch_size must be >= 1, got {per_device}")
    world = world_size(trainer_cfg)
    accumulate = int(trainer_cfg.get("accumulate_grad_batches") or 1)
    if accumulate < 1:
        raise BatchConfigError(f"trainer.accumulate_grad_batches must be >= 1, got {accumulate}")
    global_batch = data_cfg.get("global_batch_size")
    if global_batch is None:
        return {"per_device": per_device, "world": world, "accumulate": accumulate,
                "global": per_device * world * accumulate}  # fmt: skip
    global_batch = int(global_batch)
    step = per_device * world
    if global_batch < step or global_batch % step:
        raise BatchConfigError(
            f"data.global_batch_size={global_batch} is not a multiple of data.batch_size × devices × "
            f"num_nodes = {per_device} × {world // int(trainer_cfg.get('num_nodes', 1) or 1)} × "
            f"{int(trainer_cfg.get('num_nodes', 1) or 1)} = {step}: change data.global_batch_size or "
            f"data.batch_size"
        )
    derived = global_batch // step
    if accumulate not in (1, derived):
        raise BatchConfigError(
            f"trainer.accumulate_grad_batches={accumulate} contradicts data.global_batch_size="
            f"{global_batch} (which needs {derived} with data.batch_size={per_device} on {world} "
            f"processes): set one of them, not both"
        )
    return {"per_device": per_device, "world": world, "accumulate": derived, "global": global_batch}


def build_strategy(cfg: DictConfig):
    """trainer.strategy: a name Lightning knows, or ddp / fsdp with the options in trainer.ddp /
    trainer.fsdp. FSDP wraps the LightningModule, i.e. the drafter only, as one unit (the target is not
    a registered submodule; draft layers cannot be separate units because their `context_kv` runs
    outside their forward); the checkpoint is gathered into one full file on rank 0."""
    name = cfg.get("strategy", "auto")
    if name == "ddp" and cfg.get("ddp") is not None:
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(**OmegaConf.to_container(cfg.ddp, resolve=True))
    if name == "fsdp" and cfg.get("fsdp") is not None:
        from lightning.pytorch.strategies import FSDPStrategy

        opts = OmegaConf.to_container(cfg.fsdp, resolve=True)
        return FSDPStrategy(
            sharding_strategy=opts.pop("sharding_strategy", "FULL_SHARD"),
            state_dict_type=opts.pop("state_dict_type", "full"),
            cpu_offload=bool(opts.pop("cpu_offload", False)),
            **opts,
        )
    return name


def trainer_kwargs(cfg: DictConfig, accumulate: int | None = None, world: int = 1) -> dict:
    """Lightning Trainer arguments from a trainer config. `accumulate` (from resolve_batch) overrides
    trainer.accumulate_grad_batches; trainer.val_check_interval counts optimizer steps, so it is
    scaled to micro-batches here (Lightning counts batches); an integer trainer.limit_val_batches
    counts validation batches over all `world` ranks (Lightning counts per rank)."""
    t = OmegaConf.to_container(cfg, resolve=True)
    keys = (
        "accelerator",
        "devices",
        "num_nodes",
        "precision",
        "max_steps",
        "max_epochs",
        "val_check_interval",
        "limit_val_batches",
        "log_every_n_steps",
        "gradient_clip_val",
        "accumulate_grad_batches",
        "check_val_every_n_epoch",
        "num_sanity_val_steps",
        "max_time",
        "profiler",
    )
    nullable = {"check_val_every_n_epoch"}  # None is meaningful there: validate by global step
    out = {k: t[k] for k in keys if k in t and (t[k] is not None or k in nullable)}
    if accumulate is not None:
        out["accumulate_grad_batches"] = int(accumulate)
    acc = int(out.get("accumulate_grad_batches", 1))
    if isinstance(out.get("val_check_interval"), int) and acc > 1:
        out["val_check_interval"] *= acc
    limit = out.get("limit_val_batches")
    if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 and world > 1:
        out["limit_val_batches"] = -(-limit // world)
    out["strategy"] = build_strategy(cfg)
    # DraftDataModule shards batches itself (GlobalBatchSampler): Lightning must not re-wrap them.
    out["use_distributed_sampler"] = False
    return out


def anchors_per_sequence(cfg: DictConfig, datamodule) -> int:
    """The training step's anchor blocks per sequence. ``data.anchors_per_sequence``: a number caps
    (or sets) it, null takes ``drafter.num_anchors``, and ``auto`` the most anchor positions any
    training conversation has, rounded up to a multiple of 64 (fewer step shapes), at most
    ``drafter.num_anchors``: every conversation then gets the very anchors ``num_anchors`` would draw
    (all its positions, when it has no more than that), without the padding blocks past its end
    that the step would compute at zero weight (short answers: most of 512)."""
    setting = cfg.data.get("anchors_per_sequence")
    most = int(cfg.drafter.get("num_anchors", 512))
    if setting != "auto":
        return int(setting or most)
    return min(most, 64 * max(1, math.ceil(datamodule.most_anchor_positions() / 64)))


def training_vocab(cfg: DictConfig, datamodule, target) -> torch.Tensor | None:
    """The draft vocabulary the loss covers (``draft_vocab=K``): the K most frequent answer tokens
    of the training split, its end-of-sequence tokens always among them; None for the whole. The
    same counts (the drafter folder keeps them) give the same K tokens when it is served."""
    from .decoding.draft_vocab import coverage, draft_vocab_from_counts

    size = int(cfg.get("draft_vocab") or 0)
    if not size:
        return None
    counts = datamodule.answer_token_counts(target.vocab_size)
    vocab = draft_vocab_from_counts(counts, size, target.eos_token_ids)
    if vocab is not None:
        log.info(
            "draft vocabulary: %d of %d tokens, %.2f %% of the training answers' tokens",
            vocab.numel(), target.vocab_size, 100 * coverage(counts, vocab),
        )  # fmt: skip
    return vocab


def _launching_rank_zero() -> bool:
    """Whether this process is global rank 0, judged from the environment before the trainer exists
    (torchrun / SLURM / Lightning's own launcher set these; a plain run is rank 0)."""
    from lightning.fabric.utilities.rank_zero import _get_rank

    return (_get_rank() or 0) == 0 and int(os.environ.get("NODE_RANK") or 0) == 0


def run_training(cfg: DictConfig) -> dict:
    """Train into ``cfg.out_dir``, resuming from its last readable checkpoint (``cfg.resume``). The
    launching process holds the run folder's lock (and a shared one on data.dir) throughout."""
    from .data.dataset import check_data_dir

    batch = resolve_batch(cfg.data, cfg.trainer)  # config errors before any model loads
    check_data_dir(
        cfg.data, cfg.target, refuse_busy=_launching_rank_zero(), features=cfg.features
    )  # rank 0 builds it
    run = RunFolder(cfg.out_dir)
    resume = resume_point(run) if cfg.resume else None  # a checkpoint that loads, or a clear error
    with contextlib.ExitStack() as held:
        if _launching_rank_zero():  # the other ranks run under rank 0's claim
            held.enter_context(run.claimed("out_dir"))
        return _train(cfg, run, batch, resume, held)


def _check_init_from(cfg: DictConfig, folder) -> None:
    """``init_from`` names a drafter saved with this run's architecture (a folder that is no drafter
    fails in ``read_drafter_config``); the weights' shapes are checked again when they load."""
    saved = read_drafter_config(folder)
    d, h = saved.get("drafter", {}), saved.get("head") or {"name": "none"}
    head = cfg.get("head") or {"name": "none"}
    pairs = {
        "drafter": (cfg.drafter.name, d.get("name")),
        "drafter.num_layers": (cfg.drafter.get("num_layers"), d.get("num_layers")),
        "drafter.block_size": (cfg.drafter.get("block_size"), d.get("block_size")),
        "head": (head.get("name"), h.get("name", "none")),
        "head.rank": (head.get("rank"), h.get("rank")),
    }
    differ = {k: v for k, v in pairs.items() if v[1] is not None and v[0] != v[1]}
    if differ:
        asked = ", ".join(f"{k}={mine} (saved: {theirs})" for k, (mine, theirs) in differ.items())
        fix = " ".join(f"{k}={theirs}" for k, (_, theirs) in differ.items())
        raise ConfigError(f"init_from={folder} holds another drafter than this run trains: {asked}; "
                          f"train it with {fix}")  # fmt: skip


def _train(cfg: DictConfig, run: RunFolder, batch: dict, resume, held: contextlib.ExitStack) -> dict:
    resumed_at = resume[1] if resume else None
    try:
        done = run.read_summary()  # a finished run's, kept when a rerun trains nothing
    except DataError:  # unreadable: it describes nothing; this run writes a new one
        done = {}
    if resume and done and 0 < int(cfg.trainer.max_steps) <= resumed_at:
        log.info("nothing to do: %s finished at step %d (summary.json kept)", run.path, resumed_at)
        return done
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank and torch.cuda.is_available() and int(local_rank) < torch.cuda.device_count():
        # A process started for GPU k (Lightning's launcher, torchrun) loads the target straight
        # onto GPU k ("cuda" means the current device), not onto GPU 0 first.
        torch.cuda.set_device(int(local_rank))
    init_from = None if resume else cfg.get("init_from")  # a resumed run goes on from its checkpoint
    if init_from:
        _check_init_from(cfg, init_from)  # said now, before the target and the data are loaded
    L.seed_everything(int(cfg.seed), workers=True)
    out_dir = run.path
    out_dir.mkdir(parents=True, exist_ok=True)
    target = load_target(cfg.target)
    cap_cpu_threads(target.device)

    from .data.cache import target_fingerprint
    from .data.datamodule import DraftDataModule
    from .data.dataset import ensure_dataset, wait_for_dataset

    if not _launching_rank_zero():
        wait_for_dataset(cfg.data, cfg.features)  # rank 0 prepares; the others must not race it
    data_dir = ensure_dataset(cfg.data, cfg.target, target=target, features=cfg.features)
    if _launching_rank_zero():
        held.enter_context(folder_lock(data_dir, "data.dir", shared=True))  # no rebuild under us
    datamodule = DraftDataModule(
        cfg.data,
        features=cfg.features,
        target_fingerprint=target_fingerprint(target),
        pad_token_id=target.tokenizer.pad_token_id,
    )

    vocab = training_vocab(cfg, datamodule, target)
    drafter = build_drafter(TargetDims.of(target), cfg.drafter, cfg.get("head"))
    if init_from:
        warm_start(drafter, init_from, target)
        log.info("weights from %s (init_from): training goes on from them", init_from)
    module = DraftingModule(
        target,
        drafter,
        LossWeights.from_cfg(cfg.loss),
        OmegaConf.to_container(cfg.optim),
        cfg.features,
        num_anchors=anchors_per_sequence(cfg, datamodule),
        seed=int(cfg.seed),
        compile_target=cfg.get("compile_target", "auto"),
        draft_vocab=vocab,
        graph_target=cfg.get("graph_target", False),
        graph_target_multiple=int(cfg.get("graph_target_multiple", 64)),
    )
    n_params = sum(p.numel() for p in drafter.parameters())
    log.info(
        "drafter %s (%s head): %.2fM trainable parameters", cfg.drafter.name, cfg.head.name, n_params / 1e6
    )
    log.info("anchors per sequence: %d", module.num_anchors)

    throughput = Throughput(int(cfg.callbacks.get("throughput_warmup_steps", 5)))
    stop = GracefulStop(run.last_checkpoint)
    every = int(cfg.callbacks.checkpoint_every_n_steps)
    callbacks = [
        ModelCheckpoint(dirpath=run.checkpoints, save_last=True, every_n_train_steps=every, save_top_k=0),
        DrafterExport(
            run.drafter, cfg.drafter, cfg.get("head"), every, 0 if vocab is None else vocab.numel()
        ),
        throughput,
        stop,
        LearningRateMonitor(logging_interval="step"),  # logged as lr-AdamW
        RichProgressBar() if os.isatty(1) else TQDMProgressBar(refresh_rate=10),
    ]
    if cfg.callbacks.get("calibration", True) and drafter.has_confidence:
        callbacks.insert(0, CalibrationCallback())
    profile = cfg.callbacks.get("profile") or {}
    if profile.get("enabled", False):
        from .bench.step_profile import StepProfile

        options = {k: v for k, v in profile.items() if k != "enabled"}
        # Last: its step ends after every other callback's, and the time it spends writing its
        # files is no training time (the throughput leaves it out).
        callbacks.append(StepProfile(run.profile, exclude=throughput.exclude, **options))
    if resume:
        log.info("resuming from %s (step %d)", *resume)
    trainer = L.Trainer(
        **trainer_kwargs(cfg.trainer, batch["accumulate"], batch["world"]),
        logger=build_logger(cfg.logger, out_dir, cfg.run_name, cfg, resumed_at),
        callbacks=callbacks,
        plugins=[AtomicCheckpointIO()],
        default_root_dir=out_dir,
        enable_model_summary=False,
    )
    if trainer.world_size != batch["world"]:
        raise BatchConfigError(
            f"the trainer runs {trainer.world_size} processes, the batch arithmetic assumed "
            f"{batch['world']} (trainer.devices × trainer.num_nodes): set trainer.devices explicitly"
        )
    log.info(
        "batch: %d per device × %d processes × %d accumulation = %d samples per optimizer step",
        batch["per_device"], batch["world"], batch["accumulate"], batch["global"],
    )  # fmt: skip
    if trainer.is_global_zero:
        run.write_config(cfg)
    start = time.perf_counter()
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=resume and resume[0], weights_only=True)
    except SystemExit:  # Lightning exits with status 1 on a second Ctrl-C: report it as one
        if stop.hard:
            raise Interrupted(
                f"stopped at once: resume from {run.checkpoints} with hydra.run.dir={run.path}"
            ) from None
        raise
    if stop.interrupted:
        raise Interrupted(
            f"saved {run.last_checkpoint} at step {trainer.global_step}: resume with the same command "
            f"and hydra.run.dir={run.path}"
        )
    if done and resume and trainer.global_step == resumed_at:  # a finished run rerun: nothing trained
        log.info("nothing to do: %s finished at step %d (summary.json kept)", run.path, resumed_at)
        return done
    summary = {
        "run_name": cfg.run_name,
        "drafter": cfg.drafter.name,
        "head": cfg.head.name,
        "target": target.name,
        "global_step": int(trainer.global_step),
        "wall_seconds": time.perf_counter() - start,
        "trainable_parameters": n_params,
        "batch": batch,
        "strategy": type(trainer.strategy).__name__,
        "throughput": throughput.summary(),
        "final": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "data_dir": str(data_dir),
        "extra_data_dirs": [str(d) for d in cfg.data.get("extra_dirs") or []],
        # what the steps drew from (data.extra_dirs joined): the data size a result states
        "train_conversations": len(datamodule.datasets["train"]) if "train" in datamodule.datasets else None,
        "anchors_per_sequence": module.num_anchors,
    }
    if trainer.is_global_zero:  # one writer; every rank returns the summary
        run.write_summary(summary)
    if cfg.logger.name != "csv" and trainer.is_global_zero:
        from .reporting.dashboard import publish_run

        publish_run(trainer.loggers, out_dir)  # figures and tables to W&B / TensorBoard
    log.info("done: %s", json.dumps({k: summary[k] for k in ("global_step", "wall_seconds")}))
    return summary
