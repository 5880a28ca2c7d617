"""Config checks that run before any model loads, with messages that name the key to change."""

from __future__ import annotations

from omegaconf import DictConfig

from .core.errors import ConfigError, TargetError
from .target import validate_layer_ids

DRAFTERS = ("dspark", "dflash", "eagle3")
HEADS = ("markov", "gated", "rnn", "none")


def check_target(target: DictConfig) -> None:
    if target.get("num_layers"):
        try:
            validate_layer_ids(target.layer_ids, int(target.num_layers))
        except TargetError as err:
            raise ConfigError(f"target={target.name}: {err}") from None


def check_drafter(drafter: DictConfig, head: DictConfig | None) -> None:
    if drafter.name not in DRAFTERS:
        raise ConfigError(f"drafter.name '{drafter.name}' is not one of {DRAFTERS}")
    head_name = head.name if head is not None else "none"
    if head_name not in HEADS:
        raise ConfigError(f"head.name '{head_name}' is not one of {HEADS}")
    if drafter.name in ("dflash", "eagle3") and head_name != "none":
        raise ConfigError(
            f"drafter={drafter.name} has no sequential head, but head={head_name} was given: "
            f"use drafter=dspark head={head_name}, or drop the head override (head=none)"
        )
    if drafter.name == "dspark" and head_name != "none" and int(head.rank) <= 0:
        raise ConfigError(f"head.rank must be positive for head={head_name}, got {head.rank}")
    if int(drafter.block_size) < 1:
        raise ConfigError(f"drafter.block_size must be >= 1, got {drafter.block_size}")
    if int(drafter.num_layers) < 1:
        raise ConfigError(f"drafter.num_layers must be >= 1, got {drafter.num_layers}")


def check_train(cfg: DictConfig) -> None:
    check_target(cfg.target)
    check_drafter(cfg.drafter, cfg.get("head"))
    if cfg.features not in ("online", "offline"):
        raise ConfigError(f"features must be 'online' or 'offline', got '{cfg.features}'")
