"""Drafters by name. A drafter registers itself where it is defined (``@register("<name>")`` on its
class in ``dspark/drafters/<name>.py``) and ``conf/drafter/<name>.yaml`` selects it; the registry
finds the module by that name, so adding a drafter edits no list."""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil

from ..core.errors import ConfigError
from ..core.types import TargetDims
from .base import Drafter

__all__ = ["build_drafter", "drafter_class", "drafter_names", "register", "static_cache_drafters"]

_CLASSES: dict[str, type[Drafter]] = {}


def register(name: str):
    """Class decorator: make a ``Drafter`` subclass buildable as ``drafter.name=<name>``."""

    def add(cls: type[Drafter]) -> type[Drafter]:
        if not (isinstance(cls, type) and issubclass(cls, Drafter)):
            raise TypeError(f"@register('{name}') needs a Drafter subclass, got {cls!r}")
        if _CLASSES.get(name, cls) is not cls:
            raise ValueError(f"two drafters registered as '{name}': {_CLASSES[name]} and {cls}")
        cls.kind = name
        _CLASSES[name] = cls
        return cls

    return add


def _import(module: str) -> None:
    importlib.import_module(f"{__package__}.{module}")


def drafter_names() -> tuple[str, ...]:
    """Every registered drafter, after importing each module of this package once."""
    for info in pkgutil.iter_modules(importlib.import_module(__package__).__path__):
        _import(info.name)
    return tuple(_CLASSES)


def static_cache_drafters() -> tuple[str, ...]:
    """The drafters the fast engine runs (``supports_static_cache``)."""
    return tuple(n for n in drafter_names() if _CLASSES[n].supports_static_cache)


def drafter_class(name: str) -> type[Drafter]:
    """The class registered as ``name`` (found in ``dspark.drafters.<name>`` when not loaded yet)."""
    if name not in _CLASSES and name.isidentifier() and importlib.util.find_spec(f"{__package__}.{name}"):
        _import(name)
    if name not in _CLASSES:
        raise ConfigError(f"drafter.name '{name}' is not one of {drafter_names()}")
    return _CLASSES[name]


def build_drafter(dims: TargetDims, drafter_cfg, head_cfg=None) -> Drafter:
    """A new drafter for a target of ``dims`` from its config (conf/drafter, conf/head)."""
    return drafter_class(drafter_cfg.name)(dims, drafter_cfg, head_cfg)
