"""Drafters and their checkpoints. A drafter never imports Lightning."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from safetensors.torch import load_file

from ..data.io import atomic_save_safetensors, atomic_write_json
from .base import DraftCache, DraftOutput, Proposal, Shared, TargetDims
from .dflash import BlockDrafter
from .dspark import DSparkDrafter
from .eagle3 import Eagle3Drafter

__all__ = [
    "BlockDrafter",
    "DSparkDrafter",
    "Eagle3Drafter",
    "DraftCache",
    "DraftOutput",
    "Proposal",
    "Shared",
    "TargetDims",
    "build_drafter",
    "save_drafter",
    "load_drafter",
    "DrafterCheckpointError",
]

WEIGHTS = "model.safetensors"
CONFIG = "config.json"


class DrafterCheckpointError(ValueError):
    pass


def build_drafter(dims: TargetDims, drafter_cfg, head_cfg=None) -> torch.nn.Module:
    name = drafter_cfg.name
    if name == "dflash":
        return BlockDrafter(dims, drafter_cfg)
    if name == "dspark":
        return DSparkDrafter(dims, drafter_cfg, head_cfg)
    if name == "eagle3":
        return Eagle3Drafter(dims, drafter_cfg)
    raise ValueError(f"unknown drafter '{name}': choose dspark, dflash or eagle3")


def _plain(cfg):
    return OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg or {})


def save_drafter(
    drafter, folder: str | Path, drafter_cfg, head_cfg, target_info: dict, extra: dict | None = None
):
    """safetensors weights + JSON config, each written atomically."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "drafter": _plain(drafter_cfg),
        "head": _plain(head_cfg),
        "dims": asdict(drafter.dims),
        "target": target_info,
        **(extra or {}),
    }
    state = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    atomic_save_safetensors(folder / WEIGHTS, state)
    atomic_write_json(folder / CONFIG, config)


def load_drafter(folder: str | Path, target=None, device="cpu"):
    """Load a saved drafter; with a target, refuse one built for another vocabulary or hidden size."""
    folder = Path(folder)
    if not (folder / CONFIG).exists() or not (folder / WEIGHTS).exists():
        raise DrafterCheckpointError(f"{folder} is not a drafter checkpoint (needs {CONFIG} and {WEIGHTS})")
    config = json.loads((folder / CONFIG).read_text())
    dims = TargetDims(**config["dims"])
    if target is not None:
        for field, theirs in (("vocab_size", target.vocab_size), ("hidden_size", target.hidden_size)):
            if getattr(dims, field) != theirs:
                raise DrafterCheckpointError(
                    f"drafter {folder} was built for a target with {field}={getattr(dims, field)}, but "
                    f"target {target.name} has {field}={theirs}: evaluate it with the target it was trained "
                    f"for "
                    f"({config.get('target', {}).get('name', 'unknown')})"
                )
        if dims.num_taps != len(target.layer_ids):
            raise DrafterCheckpointError(
                f"drafter {folder} reads {dims.num_taps} tap layers, target {target.name} is configured with "
                f"{len(target.layer_ids)}: set target.layer_ids={config.get('target', {}).get('layer_ids')}"
            )
    drafter = build_drafter(
        dims,
        OmegaConf.create(config["drafter"]),
        OmegaConf.create(config.get("head") or {"name": "none", "rank": 0}),
    )
    drafter.load_state_dict(load_file(folder / WEIGHTS, device=str(device)))
    return drafter.to(device).eval(), config
