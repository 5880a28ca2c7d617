"""Drafters by name. A drafter registers itself where it is defined (``@register("<name>")`` on its
class in ``dspark/drafters/<name>.py``) and ``conf/drafter/<name>.yaml`` selects it; the registry
finds the module by that name, so adding a drafter edits no list."""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil

from ..core.errors import ConfigError
from ..core.schema import check
from ..core.types import TargetDims
from .base import Drafter, DrafterConfig, HeadConfig

__all__ = [
    "build_drafter",
    "check_drafter_config",
    "drafter_class",
    "drafter_names",
    "register",
    "static_cache_drafters",
]

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


def check_drafter_config(drafter_cfg, head_cfg=None, target_cfg=None) -> DrafterConfig:
    """The drafter's keys against its class's schema, the head's against ``HeadConfig``, the class's
    own rules (``Drafter.check_config``), and its attention heads against the target's where those
    are known before loading (the tiny target): a ConfigError naming the key, before anything is built."""
    cls = drafter_class(str(drafter_cfg.get("name")))
    d = check(drafter_cfg, cls.config_schema, "drafter")
    if head_cfg is not None:
        check(head_cfg, HeadConfig, "head")
    cls.check_config(drafter_cfg, head_cfg)
    tiny = target_cfg.get("tiny") if target_cfg is not None else None
    if tiny:
        heads, kv = d.num_heads or int(tiny.num_heads), d.num_kv_heads or int(tiny.num_kv_heads)
        if heads % kv:
            raise ConfigError(
                f"drafter.num_heads={heads} is not a multiple of num_kv_heads={kv} (null keys are the "
                f"target's): set drafter.num_kv_heads to a divisor of it"
            )
    return d


def build_drafter(dims: TargetDims, drafter_cfg, head_cfg=None) -> Drafter:
    """A new drafter for a target of ``dims`` from its config (conf/drafter, conf/head)."""
    return drafter_class(drafter_cfg.name)(dims, drafter_cfg, head_cfg)
