"""Config checks that run before any model loads, with messages that name the key to change."""

from __future__ import annotations

from omegaconf import DictConfig

from .core.errors import ConfigError, TargetError
from .drafters.registry import drafter_class
from .target import validate_layer_ids


def check_target(target: DictConfig) -> None:
    if target.get("num_layers"):
        try:
            validate_layer_ids(target.layer_ids, int(target.num_layers))
        except TargetError as err:
            raise ConfigError(f"target={target.name}: {err}") from None


def check_drafter(drafter: DictConfig, head: DictConfig | None) -> None:
    drafter_class(drafter.name).check_config(drafter, head)  # the drafter's own rules (heads, …)
    if int(drafter.block_size) < 1:
        raise ConfigError(f"drafter.block_size must be >= 1, got {drafter.block_size}")
    if int(drafter.num_layers) < 1:
        raise ConfigError(f"drafter.num_layers must be >= 1, got {drafter.num_layers}")


def check_train(cfg: DictConfig) -> None:
    check_target(cfg.target)
    check_drafter(cfg.drafter, cfg.get("head"))
    if cfg.features not in ("online", "offline"):
        raise ConfigError(f"features must be 'online' or 'offline', got '{cfg.features}'")
