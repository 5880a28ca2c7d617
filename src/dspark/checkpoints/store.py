"""Our drafter checkpoints: save a drafter as a folder (safetensors + JSON config) and load one
back, ours or a DeepSpec/engine-format folder (translated by dspark.interop), checked against the
target it is used with."""

from __future__ import annotations

import shutil
from dataclasses import asdict
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from safetensors.torch import load_file

from ..artifacts import DrafterFolder
from ..core.errors import DrafterCheckpointError
from ..core.types import TargetDims
from ..drafters import DrafterSpec, build_drafter
from ..interop.deepspec import is_foreign, read_state, translate, weight_files

__all__ = [
    "check_drafter_files",
    "load_drafter",
    "read_drafter_config",
    "read_drafter_spec",
    "save_drafter",
    "warm_start",
]


def _plain(cfg):
    return OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg or {})


def save_drafter(
    drafter, folder: str | Path, drafter_cfg, head_cfg, target_info: dict, extra: dict | None = None
):
    """safetensors weights + JSON config, each written atomically."""
    config = {
        "drafter": _plain(drafter_cfg),
        "head": _plain(head_cfg),
        "dims": asdict(drafter.dims),
        "target": target_info,
        **(extra or {}),
    }
    state = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    DrafterFolder(folder).write(config, state)


CAST_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def cast_drafter(src: str | Path, dst: str | Path, dtype: str) -> Path:
    """A copy of our drafter folder ``src`` at ``dst`` with its floating-point weights stored in
    ``dtype``; its other files (config, calibration, report) copied as they are. A bfloat16 copy is
    half the bytes to carry between machines and serves alike: the engines run a drafter in its
    target's precision, and loading casts the weights to the model's."""
    if dtype not in CAST_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {tuple(CAST_DTYPES)}")
    source, copy = DrafterFolder(src), DrafterFolder(dst)
    config = source.read_config()
    if is_foreign(config):
        raise DrafterCheckpointError(
            f"{source.path} is a DeepSpec/engine-format folder: cast our own checkpoints"
        )
    if copy.path.resolve() == source.path.resolve():
        raise ValueError(f"cast_drafter would overwrite its source {source.path}: give another dst")
    copy.path.mkdir(parents=True, exist_ok=True)
    for f in source.path.iterdir():
        if f.is_file() and f.name not in (source.WEIGHTS, source.CONFIG):
            shutil.copy2(f, copy.path / f.name)
    state = load_file(source.weights_path)
    cast = CAST_DTYPES[dtype]
    weights = {k: v.to(cast) if v.is_floating_point() else v for k, v in state.items()}
    copy.write(config, weights)  # weights first, then the config: complete once it exists
    return copy.path


def read_drafter_config(folder: str | Path) -> dict:
    """A drafter folder's config in our schema (drafter / head / dims / target); a DeepSpec- or
    engine-format folder (config.json with `architectures`) is translated (dspark.interop)."""
    folder = DrafterFolder(folder)
    config = folder.read_config()
    if is_foreign(config):
        return translate(config, folder.path)
    if "drafter" not in config or "dims" not in config:
        raise DrafterCheckpointError(
            f"{folder.config_path} is neither our checkpoint (drafter/dims keys) nor a DeepSpec/engine "
            f"drafter (architectures)"
        )
    return config


def read_drafter_spec(folder: str | Path) -> DrafterSpec:
    """What the checkpoint in ``folder`` is (kind, γ, capabilities), without loading its weights."""
    return DrafterSpec.from_config(read_drafter_config(folder))


def check_drafter_files(folder: str | Path) -> DrafterSpec:
    """read_drafter_spec, plus what loading the folder would trip on, found without loading it: a
    weights file that is not a complete safetensors file (its header and size are read), and a
    calibration.json that is not one temperature per draft position."""
    from safetensors import safe_open

    files = DrafterFolder(folder)
    config = read_drafter_config(files.path)
    spec = DrafterSpec.from_config(config)
    paths = weight_files(files.path) if "imported_from" in config else [files.weights_path]
    for path in paths:
        try:
            with safe_open(str(path), framework="pt"):
                pass
        except Exception as err:  # SafetensorError, or an OSError of a missing file
            raise DrafterCheckpointError(
                f"{path} is not a readable safetensors file ({err}): re-export or retrain the drafter"
            ) from None
    calibration = files.read_calibration()
    if calibration is not None and len(calibration.temperatures) != spec.gamma:
        raise DrafterCheckpointError(
            f"{files.file(files.CALIBRATION)} holds {len(calibration.temperatures)} temperatures for a "
            f"drafter of {spec.gamma} positions: delete it, or refit it (evaluate calibrate=true)"
        )
    return spec


def load_drafter(folder: str | Path, target=None, device="cpu", served: bool = True):
    """Load a saved drafter (ours, or a DeepSpec/engine-format DSpark/DFlash folder); with a target,
    refuse one built for another vocabulary, hidden size or tap layers. ``served``: in the target's
    precision, as the engines serve it; else in the file's (a warm start trains from it)."""
    files = DrafterFolder(folder)
    folder = files.path
    config = read_drafter_config(folder)
    foreign = "imported_from" in config
    if not foreign and not files.weights_path.exists():
        raise DrafterCheckpointError(
            f"{folder} is not a drafter checkpoint (needs {files.CONFIG} and {files.WEIGHTS})"
        )
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
        if dims.num_taps != len(target.layer_ids) or (
            foreign and list(config["target"]["layer_ids"]) != list(target.layer_ids)
        ):
            recorded = config.get("target", {}).get("layer_ids")
            raise DrafterCheckpointError(
                f"drafter {folder} reads {dims.num_taps} tap layers {recorded or ''}, target "
                f"{target.name} is configured with {list(target.layer_ids)}: set target.layer_ids={recorded}"
            )
    drafter = build_drafter(
        dims,
        OmegaConf.create(config["drafter"]),
        OmegaConf.create(config.get("head") or {"name": "none", "rank": 0}),
    )
    if foreign:
        state = read_state(folder, config, files.read_config(), target)
    else:
        try:
            state = load_file(files.weights_path, device=str(device))
        except Exception as err:  # SafetensorError: truncated or not safetensors at all
            why = f"{files.weights_path} is not a readable safetensors file ({err})"
            raise DrafterCheckpointError(why) from None
    try:
        drafter.load_state_dict(state)
    except RuntimeError as err:  # missing / unexpected keys, other shapes
        raise DrafterCheckpointError(
            f"{folder}: the weights do not fit its config.json ({' '.join(str(err).split())[:300]})"
        ) from None
    # Served in the target's precision (a bf16 target drafts with a bf16 drafter, as engines do).
    dtype = target.dtype if target is not None and served else None
    return drafter.to(device=device, dtype=dtype).eval(), config


def warm_start(drafter, folder: str | Path, target=None) -> dict:
    """Copy the weights of the drafter saved in ``folder`` (ours, DeepSpec's or an engine's) into
    ``drafter``, for training to go on from them (``train.init_from``): the same architecture,
    every tensor the same shape, or an error naming the settings to train with. Returns the saved
    config."""
    saved, config = load_drafter(folder, target, served=False)
    mine, theirs = drafter.state_dict(), saved.state_dict()
    differ = [k for k in sorted(mine.keys() | theirs.keys())
              if k not in mine or k not in theirs or mine[k].shape != theirs[k].shape]  # fmt: skip
    if differ:
        d, h = config.get("drafter", {}), config.get("head") or {}
        saved_as = (
            f"drafter={d.get('name')} drafter.num_layers={d.get('num_layers')} drafter.block_size="
            f"{d.get('block_size')} head={h.get('name', 'none')} head.rank={h.get('rank')}"
        )
        raise DrafterCheckpointError(
            f"init_from={folder}: its weights do not fit this run's drafter ({', '.join(differ[:4])}"
            f"{' ...' if len(differ) > 4 else ''}); train with the settings it was saved with: {saved_as}"
        )
    with torch.no_grad():
        for name, tensor in mine.items():
            tensor.copy_(theirs[name])
    return config
