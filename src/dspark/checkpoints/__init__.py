"""Drafter checkpoints on disk: ours (save / load / spec), DeepSpec- and engine-format folders read
through dspark.interop, and export into those formats."""

from .export import export_drafter, refusal
from .store import (
    cast_drafter,
    check_drafter_files,
    load_drafter,
    read_drafter_config,
    read_drafter_spec,
    save_drafter,
    warm_start,
)

__all__ = [
    "cast_drafter",
    "check_drafter_files",
    "export_drafter",
    "load_drafter",
    "read_drafter_config",
    "read_drafter_spec",
    "refusal",
    "save_drafter",
    "warm_start",
]
