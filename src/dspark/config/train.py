"""The train and prepare configs as schemas (dspark.core.schema) and their checks: every key, its
type and range, unknown keys refused, the rules across groups, all before any model loads. The
groups are the schemas of the units that own them (target, drafters, objectives, data)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from omegaconf import DictConfig

from ..core.errors import ConfigError
from ..core.schema import Count, Fraction, Natural, NonNegative, Pattern, Positive, Range, Unit, check
from ..data.config import DataConfig
from ..drafters.base import HeadConfig
from ..drafters.registry import check_drafter_config
from ..objectives import LossWeights
from ..target import TargetConfig, known_context_length

PRECISIONS = Literal[
    "64-true",
    "32-true",
    "16-true",
    "bf16-true",
    "16-mixed",
    "bf16-mixed",
    "transformer-engine",
    "transformer-engine-float16",
    "64",
    "32",
    "16",
    "bf16",
    64,
    32,
    16,
]  # fmt: skip  (Lightning's accepted precisions)
DURATION = Annotated[str, Pattern(r"\d+:\d{1,2}:\d{1,2}:\d{1,2}", "DD:HH:MM:SS, e.g. 00:01:30:00")]


@dataclass
class DDPOptions:
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = True
    static_graph: bool = False


@dataclass
class FSDPOptions:
    sharding_strategy: Literal["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"] = "FULL_SHARD"
    state_dict_type: Literal["full", "sharded"] = "full"
    cpu_offload: bool = False


@dataclass
class TrainerConfig:
    accelerator: Literal["cpu", "gpu", "cuda", "mps", "tpu", "auto"]
    devices: Literal["auto", -1] | Count | list[Natural] | Annotated[str, Pattern(r"\d+(,\d*)*", "0,1")]
    strategy: str
    precision: PRECISIONS
    max_steps: Literal[-1] | Count  # -1: no step limit
    num_nodes: Count = 1
    max_epochs: Literal[-1] | Count | None = -1
    val_check_interval: Count | Annotated[float, Range(gt=0, le=1)] = 1.0  # steps, or a share of an epoch
    limit_val_batches: Natural | Unit = 1.0
    num_sanity_val_steps: Annotated[int, Range(ge=-1)] = 2
    log_every_n_steps: Count = 50
    gradient_clip_val: NonNegative | None = None
    accumulate_grad_batches: Count = 1
    check_val_every_n_epoch: Count | None = None
    max_time: DURATION | None = None
    profiler: Literal["simple", "advanced", "pytorch"] | None = None  # Lightning's profilers
    ddp: DDPOptions | None = None
    fsdp: FSDPOptions | None = None

    def __post_init__(self):
        from lightning.pytorch.strategies import StrategyRegistry

        names = ("auto", *StrategyRegistry.available_strategies())
        if self.strategy not in names:
            raise ConfigError(f"strategy={self.strategy!r} is not a Lightning strategy: auto, ddp, fsdp, …")


@dataclass
class LoggerConfig:
    name: Literal["csv", "tensorboard", "wandb"]
    project: str | None = None
    group: str | None = None
    tags: list[str] = field(default_factory=list)
    run_name: str | None = None
    mode: Literal["offline", "online", "disabled"] | None = None


@dataclass
class ProfileConfig:
    """callbacks.profile: a torch.profiler window inside the run (bench.step_profile.StepProfile)."""

    enabled: bool = False
    start_step: Count = 200  # the first recorded optimizer step: after warm-up and compilation
    steps: Count = 10  # a log step among them when log_every_n_steps is 10: the steady average
    warmup_steps: Natural = 1  # recorded before start_step and left out (the profiler's start-up)
    top: Count = 30  # kernels listed
    keep_trace: bool = True  # profile/trace.json.gz beside the tables

    def __post_init__(self):
        if self.start_step <= self.warmup_steps:
            raise ConfigError(
                f"callbacks.profile.start_step={self.start_step} must exceed callbacks.profile.warmup_steps="
                f"{self.warmup_steps}: the window opens after step start_step - warmup_steps >= 1"
            )


@dataclass
class CallbacksConfig:
    calibration: bool = True
    checkpoint_every_n_steps: Count = 100
    throughput_warmup_steps: Natural = 5
    profile: ProfileConfig = field(default_factory=ProfileConfig)


@dataclass
class OptimConfig:
    lr: Positive
    weight_decay: NonNegative = 0.0
    betas: list[Fraction] = field(default_factory=lambda: [0.9, 0.95])
    warmup_ratio: Fraction = 0.0
    min_lr_ratio: Unit = 0.1
    # What the learning-rate schedule follows (module.run_progress): auto, the further along of the
    # steps (trainer.max_steps) and the clock (trainer.max_time); steps or clock alone.
    schedule_by: Literal["auto", "steps", "clock"] = "auto"

    def __post_init__(self):
        if len(self.betas) != 2:
            raise ConfigError(f"betas={self.betas} must hold two numbers in [0, 1), e.g. [0.9, 0.95]")


@dataclass
class TrainConfig:
    target: TargetConfig
    drafter: dict[str, Any]  # its class's schema (Drafter.config_schema), checked by check_drafter
    head: HeadConfig
    loss: LossWeights
    data: DataConfig
    trainer: TrainerConfig
    logger: LoggerConfig
    callbacks: CallbacksConfig
    optim: OptimConfig
    seed: int
    run_name: str
    out_dir: str
    resume: bool
    features: Literal["online", "offline"]
    compile_target: Literal["auto", True, False] = "auto"  # the target's forward in the training step
    graph_target: Literal["auto", True, False] = False  # that forward replayed from CUDA graphs
    graph_target_multiple: Positive = 64  # ...one per batch length rounded up to this many tokens
    draft_vocab: Natural = 0  # the loss over the K most frequent answer tokens (objectives.restrict_to_vocab)
    init_from: str | None = None  # a saved drafter whose weights start the run (warm start)

    def __post_init__(self):
        by = self.optim.schedule_by
        if by == "clock" and self.trainer.max_time is None:
            raise ConfigError(
                "optim.schedule_by=clock needs a clock to follow: set trainer.max_time (e.g. 00:00:10:00), "
                "or schedule by steps"
            )
        if by == "steps" and self.trainer.max_steps == -1:
            raise ConfigError(
                "optim.schedule_by=steps needs steps to follow: set trainer.max_steps, or schedule by "
                "the clock (auto or clock, with trainer.max_time)"
            )


@dataclass
class PrepareConfig:
    target: TargetConfig
    data: DataConfig
    seed: int = 0
    force: bool = False


def check_target(target: DictConfig) -> TargetConfig:
    return check(target, TargetConfig, "target")


check_drafter = check_drafter_config  # the drafter's own keys and rules live with the drafters


def check_context(target: DictConfig, keys: dict[str, int | None]) -> None:
    """Each of ``keys`` (name -> tokens) fits the target's context window, when it is known
    without loading weights."""
    context = known_context_length(target)
    for key, tokens in keys.items():
        if context is not None and tokens is not None and tokens >= context:
            raise ConfigError(
                f"{key}={tokens} does not fit target {target.name}'s context of {context} tokens: "
                f"set {key} < {context}"
            )


def check_data(cfg: DictConfig) -> None:
    """Data keys against the target: the kept length and the answer budget fit its context."""
    answer = cfg.data.max_new_tokens or cfg.target.generation.max_new_tokens
    check_context(cfg.target, {"data.max_length": int(cfg.data.max_length), "data.max_new_tokens": answer})


def check_train(cfg: DictConfig) -> TrainConfig:
    out = check(cfg, TrainConfig)
    check_drafter(cfg.drafter, cfg.get("head"), cfg.target)
    check_data(cfg)
    return out


def check_prepare(cfg: DictConfig) -> PrepareConfig:
    out = check(cfg, PrepareConfig)
    check_data(cfg)
    return out
