"""Drafters: the ``Drafter`` interface, the registry that builds one by its config name, and the
spec of a saved one. A drafter never imports Lightning, the engines or the checkpoint code."""

from .base import Drafter
from .registry import build_drafter, drafter_class, drafter_names, register, static_cache_drafters
from .spec import DrafterSpec

__all__ = [
    "Drafter",
    "DrafterSpec",
    "build_drafter",
    "drafter_class",
    "drafter_names",
    "register",
    "static_cache_drafters",
]
