"""The evaluate, schedule, report and export configs as schemas (dspark.core.schema), and their
checks: every key typed and bounded, unknown keys refused, then each stage's own checks against
the drafter checkpoint, all before any model loads."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from omegaconf import DictConfig, OmegaConf

from ..core.errors import ConfigError
from ..core.schema import Count, Natural, NonNegative, Positive, Unit, check
from ..decoding.fast_engine import ENGINES
from ..drafters import DrafterSpec
from ..interop.formats import FORMATS
from ..target import TargetConfig
from .train import LoggerConfig, check_context

ENGINE = Literal[ENGINES]


@dataclass
class EvalCalibration:
    file: str | None = None
    prompts: Natural = 10
    max_new_tokens: Count | None = None
    save_to_drafter: bool = False
    n_bins: Count = 15
    offsets: bool = False


@dataclass
class EvaluateConfig:
    target: TargetConfig
    policy: dict[str, Any]  # a policy config: scheduling.build_policy checks its keys
    drafter_dir: str
    benchmarks: list[str]
    benchmark_dir: str | None
    max_prompts: Count | None  # per benchmark; null = all
    max_new_tokens: Count
    temperature: NonNegative
    concurrency: Count
    engine: ENGINE
    seed: int
    calibrate: bool
    calibration: EvalCalibration
    thresholds: list[Unit]
    progress: bool
    out_dir: str
    engine_compile: bool | None = None  # fast engine: compile target and drafter (null: on CUDA)
    draft_vocab: Natural | None = None  # the drafter's K most frequent answer tokens; 0: all; None: its own
    draft_vocab_counts: str | None = None  # their counts: null = the drafter folder's; else a data folder


@dataclass
class Replay:
    steps: Count = 400
    warmup: Natural = 2
    outcome: Literal["recorded", "expected"] = "recorded"


@dataclass
class AnalyticalCost:
    base_ms: Positive = 20.0
    knee: Count = 256
    ms_per_token: Positive | None = None
    max_batch: Count = 4096
    tile: Count | None = None
    draft_ms: NonNegative | None = None


@dataclass
class Measured:
    benchmarks: list[str] = field(default_factory=lambda: ["gsm8k"])
    benchmark_dir: str | None = None
    max_prompts: Count | None = 16
    max_new_tokens: Count = 64
    temperature: NonNegative = 1.0
    warmup: bool = True
    repeats: Count = 1  # timed runs per point from the same seed; the run of median throughput is kept
    engine: ENGINE = "plain"
    compile: bool | None = None  # fast engine: compile target and drafter (null: on CUDA)
    draft_vocab: Natural | None = None  # the drafter's K most frequent answer tokens; 0: all; None: its own
    draft_vocab_counts: str | None = None  # their counts: null = the drafter folder's; else a data folder


@dataclass
class Profile:
    batch_sizes: list[Count] | None = None
    draft: bool = True
    warmup: Natural = 2
    repeats: Count = 5


@dataclass
class ScheduleConfig:
    target: TargetConfig
    mode: Literal["analytical", "measured", "e2e"]
    rounds: str | list[str] | None
    calibration: str | None
    drafter_dir: str | None
    cost_table: str | None
    policies: list[str]
    concurrency: Count | list[Count]
    gamma: Count | None
    threshold: Unit
    async_delay: Natural
    context_len: Count
    seed: int
    progress: bool
    replay: Replay
    analytical_cost: AnalyticalCost
    measured: Measured
    profile: Profile
    out_dir: str
    e2e: str | None = None  # mode=e2e: the JSON python -m dspark.bench.e2e wrote
    e2e_temperature: NonNegative | None = None  # mode=e2e: which of its temperatures


@dataclass
class ReportConfig:
    runs: str | list[str]
    axis: str | None
    title: str
    out_dir: str
    logger: LoggerConfig | None = None
    mode: Literal["dashboard", "table1", "figures", "head_latency", "tau_by_axis"] = "dashboard"
    table1: str | None = None  # mode=table1: where table1.json goes (null: out_dir/table1.json)
    split_gamma: bool = False  # mode=table1: one table per (temperature, γ), for block-size sweeps


@dataclass
class ExportConfig:
    drafter_dir: str
    format: Literal[FORMATS]
    out: str
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    embeddings: bool | None = None
    force: bool = False  # replace the drafter files of a non-empty `out`
    target: TargetConfig | None = None


def check_evaluate(cfg: DictConfig) -> DrafterSpec:
    """The keys, then the config against the checkpoint (evaluation.check_config), then the decoding
    budgets against the target's context."""
    from ..evaluation import check_config

    check(cfg, EvaluateConfig)
    spec = check_config(cfg)
    budgets = {"max_new_tokens": cfg.max_new_tokens}
    budgets["calibration.max_new_tokens"] = cfg.calibration.max_new_tokens
    check_context(cfg.target, budgets)
    return spec


def check_schedule(cfg: DictConfig) -> None:
    from ..frontier import check_config

    check(cfg, ScheduleConfig)
    check_config(cfg)
    if cfg.mode == "measured":
        budgets = {"measured.max_new_tokens": cfg.measured.max_new_tokens, "context_len": cfg.context_len}
        check_context(cfg.target, budgets)


def check_report(cfg: DictConfig) -> ReportConfig:
    return check(cfg, ReportConfig)


def check_export(cfg: DictConfig) -> tuple[dict, bool]:
    """Export's config (the checkpoint's config, and whether the target is needed), before any
    model loads: the keys, the folders (``out`` neither the source nor a non-empty folder without
    force=true), the format against the checkpoint."""
    from ..artifacts import DrafterFolder
    from ..checkpoints import check_drafter_files, read_drafter_config, refusal

    for key in ("drafter_dir", "out"):
        if OmegaConf.is_missing(cfg, key) or cfg.get(key) is None:
            raise ConfigError(
                f"{key} is required: python -m dspark.export drafter_dir=<dir> format=hf out=<dir>"
            )
    check(cfg, ExportConfig)
    folder = Path(str(cfg.drafter_dir)).expanduser()
    if not DrafterFolder(folder).exists():
        raise ConfigError(f"drafter_dir={folder} is not a drafter checkpoint (no config.json there)")
    out = Path(str(cfg.out)).expanduser()
    if out.resolve() == folder.resolve():
        raise ConfigError(f"out={out} is drafter_dir itself: export into another folder")
    if out.is_dir() and any(out.iterdir()) and not cfg.force:
        raise ConfigError(f"out={out} is not empty: choose an empty folder, or force=true to replace it")
    check_drafter_files(folder)
    config = read_drafter_config(folder)
    why = refusal(str(cfg.format), config)
    if why:
        raise ConfigError(f"cannot export drafter_dir={folder} as format={cfg.format}: {why}")
    embeddings = cfg.format == "hf" if cfg.embeddings is None else bool(cfg.embeddings)
    if embeddings:
        recorded = (config.get("target") or {}).get("name")
        chosen = cfg.get("target") and cfg.target.get("name")
        if not chosen:
            raise ConfigError(
                f"format={cfg.format} ships the target's embed_tokens/lm_head (DeepSpec's loader reads "
                f"them from the drafter folder): add target={recorded or '<its target>'}, or embeddings=false"
            )
        if recorded and recorded != "unknown" and chosen != recorded:
            raise ConfigError(f"drafter_dir={folder} was trained for target {recorded}, not target={chosen}")
    return config, embeddings
