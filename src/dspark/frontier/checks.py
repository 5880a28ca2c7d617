"""Schedule's config checked before any model loads, and what it is built from: the policies of the
sweep (one factory, dspark.scheduling.policies.build_policy), the longest draft they verify, the
cost model (a profiled table or the SYNTHETIC roofline). Mistakes are ConfigErrors naming the key."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

from ..artifacts import DrafterFolder
from ..checkpoints import check_drafter_files
from ..core.errors import ConfigError
from ..drafters import DrafterSpec
from ..scheduling.cost import CostModel, CostTableError
from ..scheduling.policies import Policy, build_policy

log = logging.getLogger(__name__)


def check_config(cfg: DictConfig) -> None:
    if cfg.mode not in ("analytical", "measured", "e2e"):
        raise ConfigError(f"mode must be 'analytical', 'measured' or 'e2e', got '{cfg.mode}'")
    if cfg.mode == "e2e":
        if cfg.get("e2e") is None or not Path(str(cfg.e2e)).expanduser().is_file():
            raise ConfigError(f"e2e={cfg.get('e2e')}: give the json of python -m dspark.bench.e2e (mode=e2e)")
        return
    conc = list(cfg.concurrency) if isinstance(cfg.concurrency, ListConfig) else [cfg.concurrency]
    if not conc or any(not isinstance(r, int) or isinstance(r, bool) or r < 1 for r in conc):
        raise ConfigError(f"concurrency must be a list of integers >= 1, got {cfg.concurrency}")
    if not cfg.policies:
        raise ConfigError("policies is empty: e.g. policies=[mtp1,fixed,hardware_aware]")
    if cfg.gamma is not None and int(cfg.gamma) < 1:
        raise ConfigError(f"gamma must be >= 1 (or null for the drafter's block), got {cfg.gamma}")
    policies = sweep_policies(cfg)  # names and arguments; γ bounds are checked once the block is known
    for name, policy in policies.items():
        if not policy.lossless:
            log.warning("policy %s is NOT lossless (Appendix A); it is a diagnostic upper bound", name)
    if cfg.cost_table is not None and not Path(str(cfg.cost_table)).expanduser().is_file():
        raise ConfigError(f"cost_table={cfg.cost_table}: no such file (null: synthetic / profile)")
    if cfg.cost_table is not None:
        load_cost(cfg)  # a readable table, before any rounds are read or models load
    if cfg.mode == "analytical":
        if cfg.rounds is None:
            raise ConfigError(
                "rounds is required in analytical mode: rounds=<evaluation folder or rounds.jsonl> "
                "(python -m dspark.evaluate policy=fixed policy.gamma=null writes one)"
            )
        if int(cfg.replay.steps) < 1 or int(cfg.replay.warmup) < 0:
            raise ConfigError(f"replay.steps must be >= 1 and replay.warmup >= 0, got {cfg.replay}")
        if cfg.replay.outcome not in ("recorded", "expected"):
            raise ConfigError(f"replay.outcome must be 'recorded' or 'expected', got '{cfg.replay.outcome}'")
        if cfg.calibration is not None and not Path(str(cfg.calibration)).expanduser().exists():
            raise ConfigError(f"calibration={cfg.calibration}: no such file")
    else:
        if cfg.drafter_dir is None:
            raise ConfigError("drafter_dir is required in measured mode: drafter_dir=<checkpoint dir>")
        spec = drafter_spec(cfg)
        needy = [name for name, p in policies.items() if p.needs_confidence]
        if needy and not spec.has_confidence:
            raise ConfigError(
                f"policies {needy} need confidences, but the {spec.kind} drafter in {cfg.drafter_dir} has "
                "no confidence head: keep fixed/mtp1 policies only"
            )
        if int(cfg.measured.max_new_tokens) < 1 or float(cfg.measured.temperature) < 0:
            raise ConfigError("measured.max_new_tokens must be >= 1 and measured.temperature >= 0")
        if int(cfg.context_len) < 1:
            raise ConfigError(f"context_len must be >= 1, got {cfg.context_len}")


def drafter_spec(cfg: DictConfig) -> DrafterSpec:
    folder = Path(str(cfg.drafter_dir)).expanduser()
    if not DrafterFolder(folder).exists():
        raise ConfigError(f"drafter_dir={folder} is not a drafter checkpoint (no config.json there)")
    return check_drafter_files(folder)  # ours, or a DeepSpec/engine-format folder (translated)


def sweep_gamma(cfg: DictConfig, block: int) -> int:
    """The longest draft any policy of the sweep verifies (cfg.gamma, at most the block)."""
    g = block if cfg.gamma is None else int(cfg.gamma)
    if g > block:
        raise ConfigError(f"gamma={g} exceeds the drafter's block size {block}: set gamma<={block} or null")
    return g


def sweep_policies(cfg: DictConfig, gamma: int | None = None, block: int | None = None) -> dict[str, Policy]:
    """The policies of ``cfg.policies`` by their sweep name."""
    defaults = {"threshold": float(cfg.threshold), "delay": int(cfg.async_delay), "check": False}
    out = {}
    for spec in cfg.policies:
        try:
            out[str(spec)] = build_policy(str(spec), gamma=gamma, block=block, defaults=defaults)
        except ConfigError as err:
            raise ConfigError(f"policies: {err}") from None
    return out


def load_cost(cfg: DictConfig):
    path = Path(str(cfg.cost_table)).expanduser()
    try:
        cost = CostModel.load(path)
    except (CostTableError, json.JSONDecodeError, KeyError, TypeError) as err:
        raise ConfigError(f"cost_table={cfg.cost_table}: not a valid cost table ({err})") from None
    cost.meta.setdefault("source", str(path.resolve()))
    return cost


def synthetic_cost(cfg: DictConfig):
    kw = OmegaConf.to_container(cfg.analytical_cost, resolve=True)
    try:
        cost = CostModel.analytical(**kw, context_len=int(cfg.context_len))
    except (CostTableError, TypeError) as err:
        raise ConfigError(f"analytical_cost: {err}") from None
    cost.meta["source"] = "synthetic roofline (CostModel.analytical), not a measurement"
    log.warning(
        "cost_table=null: pricing rounds on a SYNTHETIC roofline %s; the frontier shows the shape of "
        "the trade-off, not any real hardware. Profile one with mode=measured.",
        kw,
    )
    return cost
