"""Evaluate's config checked against the drafter checkpoint's spec, before any model loads; each
mistake is a ConfigError naming the key to change."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from ..artifacts import DrafterFolder
from ..checkpoints import check_drafter_files
from ..core.errors import ConfigError
from ..data.datamodule import tokens_path
from ..data.vocab_counts import served_vocab_size
from ..decoding.fast_engine import ENGINES
from ..drafters import DrafterSpec, static_cache_drafters
from ..scheduling.cost import CostModel, CostTableError
from ..scheduling.policies import Fixed, build_policy


def check_config(cfg: DictConfig) -> DrafterSpec:
    """The spec of ``cfg.drafter_dir`` (ours, or a DeepSpec/engine-format folder, translated) when
    the rest of the config can run with it."""
    if OmegaConf.is_missing(cfg, "drafter_dir") or cfg.get("drafter_dir") is None:
        raise ConfigError("drafter_dir is required: python -m dspark.evaluate drafter_dir=<checkpoint dir>")
    folder = Path(str(cfg.drafter_dir)).expanduser()
    if not DrafterFolder(folder).exists():
        raise ConfigError(f"drafter_dir={folder} is not a drafter checkpoint (no config.json there)")
    spec = check_drafter_files(folder)  # the weights and calibration.json readable
    if not cfg.benchmarks:
        raise ConfigError("benchmarks is empty: e.g. benchmarks=[gsm8k,mt-bench]")
    if float(cfg.temperature) < 0:
        raise ConfigError(f"temperature must be >= 0, got {cfg.temperature}")
    if int(cfg.concurrency) < 1:
        raise ConfigError(f"concurrency must be >= 1, got {cfg.concurrency}")
    if int(cfg.max_new_tokens) < 1:
        raise ConfigError(f"max_new_tokens must be >= 1, got {cfg.max_new_tokens}")
    engine = str(cfg.get("engine", "plain"))
    if engine not in ENGINES:
        raise ConfigError(f"engine={engine} is not one of {', '.join(ENGINES)}")
    if engine == "fast" and not spec.supports_static_cache:
        raise ConfigError(
            f"engine=fast drafts with block drafters ({', '.join(static_cache_drafters())}); "
            f"{spec.kind} runs on engine=plain"
        )
    size = served_vocab_size(cfg.get("draft_vocab"), folder)  # its sign: the schema's (config.apps)
    counts = cfg.get("draft_vocab_counts")
    if int(size) and counts is None and DrafterFolder(folder).read_token_counts() is None:
        raise ConfigError(
            f"draft_vocab={size} picks the drafter's most frequent answer tokens, but {folder} has no "
            f"{DrafterFolder.TOKEN_COUNTS} (trained before training wrote them): pass "
            f"draft_vocab_counts=<the data folder it was trained on>"
        )
    source = None if counts is None else Path(str(counts)).expanduser()
    if source is not None and not (source.is_file() or tokens_path(source, "train").is_file()):
        raise ConfigError(
            f"draft_vocab_counts={counts} is neither a token counts file nor a data folder with its "
            f"tokenised training split ({tokens_path(source, 'train')})"
        )
    policy = build_policy(cfg.policy)
    if isinstance(policy, Fixed) and policy.gamma is not None and policy.gamma > spec.gamma:
        raise ConfigError(
            f"policy.gamma={policy.gamma} exceeds the {spec.gamma} tokens the drafter in {folder} drafts "
            f"per round (its block): set policy.gamma<={spec.gamma}, or policy.gamma=null (the default) "
            f"for the whole block"
        )
    if policy.needs_confidence and not spec.has_confidence:
        raise ConfigError(
            f"policy={policy.name} needs confidences, but the drafter in {folder} ({spec.kind}) "
            f"has no confidence head: use policy=fixed or policy=mtp1"
        )
    if policy.needs_cost and not cfg.policy.get("cost_table"):
        raise ConfigError(
            f"policy={policy.name} needs a profiled cost table: "
            f"set policy.cost_table=<json> (python -m dspark.schedule)"
        )
    if cfg.policy.get("cost_table"):  # readable now, not after the models load
        try:
            CostModel.load(cfg.policy.cost_table)
        except (CostTableError, OSError) as err:
            raise ConfigError(f"policy.cost_table={cfg.policy.cost_table}: {err}") from None
    if cfg.calibrate and not spec.has_confidence:
        raise ConfigError(
            f"calibrate=true needs a drafter with a confidence head; {folder} holds a "
            f"{spec.kind} drafter without one"
        )
    if cfg.calibrate and not cfg.calibration.get("file") and int(cfg.calibration.prompts) < 1:
        raise ConfigError("calibrate=true needs calibration.prompts >= 1 or calibration.file=<jsonl>")
    return spec
