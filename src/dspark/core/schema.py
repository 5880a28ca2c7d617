"""Config schemas: a dataclass per config node whose annotated fields say what each key may hold
(``int``, ``float``, ``bool``, ``str``, ``Literal``, unions with ``None``, lists, dicts, nested
dataclasses, and ``Annotated`` rules such as ``Range``). ``check`` walks a config against one before
anything runs: it refuses unknown and missing keys, wrong types, values out of range, and whatever
the dataclass's ``__post_init__`` refuses across keys, with one ``ConfigError`` naming the key, the
value and what it may be."""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar, Union

from .errors import ConfigError

T = TypeVar("T")


@dataclass(frozen=True)
class Range:
    """Bounds of a number (any of them may be left out)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def __call__(self, value) -> str | None:
        ok = (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
            and (self.lt is None or value < self.lt)
        )
        return None if ok else f"must be {self}"

    def __str__(self) -> str:
        parts = ((">=", self.ge), (">", self.gt), ("<=", self.le), ("<", self.lt))
        return " and ".join(f"{op} {_num(b)}" for op, b in parts if b is not None)


@dataclass(frozen=True)
class Pattern:
    """A string matching a regular expression; ``shape`` tells the user what it looks like."""

    regex: str
    shape: str

    def __call__(self, value) -> str | None:
        return None if re.fullmatch(self.regex, value) else f"must look like {self.shape}"


# The kinds of value most keys hold.
Count = Annotated[int, Range(ge=1)]  # sizes, steps, batches
Natural = Annotated[int, Range(ge=0)]
NonNegative = Annotated[float, Range(ge=0)]
Positive = Annotated[float, Range(gt=0)]
Fraction = Annotated[float, Range(ge=0, lt=1)]  # a share of something, 1 excluded
Unit = Annotated[float, Range(ge=0, le=1)]
Probability = Annotated[float, Range(gt=0, le=1)]  # top-p


def check(node: Any, schema: type[T], where: str = "") -> T:
    """``node`` (a DictConfig or a mapping) as an instance of the dataclass ``schema``, or a
    ConfigError naming the first key that does not fit. ``where`` prefixes the key names."""
    from omegaconf import DictConfig, ListConfig
    from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

    if isinstance(node, (DictConfig, ListConfig)):
        try:
            node = _plain(node)
        except MissingMandatoryValue as err:
            key = err.full_key or where
            raise ConfigError(f"{key} is required (it is ???): set {key}=…") from None
        except OmegaConfBaseException as err:
            raise ConfigError(f"{err.full_key or where or 'the config'}: {_msg(err)}") from None
    return _value(node, schema, where)


def _plain(node: Any) -> Any:
    """A config node as plain containers, interpolations resolved against its root, except Hydra's
    own (``${hydra:…}``, e.g. out_dir), which only a Hydra run can resolve: they stay as text."""
    from omegaconf import DictConfig, ListConfig
    from omegaconf.errors import InterpolationResolutionError

    if isinstance(node, ListConfig):
        return [_plain(node[i]) for i in range(len(node))]
    if not isinstance(node, DictConfig):
        return node
    out = {}
    for key in node:
        try:
            out[key] = _plain(node[key])
        except InterpolationResolutionError as err:
            if "HydraConfig was not set" not in str(err):
                raise
            out[key] = node._get_node(key)._value()  # the text of the interpolation
    return out


def _value(value: Any, kind: Any, where: str) -> Any:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is Annotated:
        out = _value(value, args[0], where)
        for rule in args[1:]:
            problem = rule(out) if out is not None else None
            if problem:
                raise ConfigError(f"{where}={_show(value)}: {problem}")
        return out
    if origin in (Union, types.UnionType):
        nullable = type(None) in args
        if value is None and nullable:
            return None
        for arm in (a for a in args if a is not type(None)):
            if _fits(value, arm):  # the arm of this value's shape says what is wrong with it
                try:
                    return _value(value, arm, where)
                except ConfigError as err:
                    raise ConfigError(f"{err} (or null)" if nullable else str(err)) from None
        raise ConfigError(f"{where}={_show(value)}: must be {_describe(kind)}")
    if origin is Literal:
        if any(type(value) is type(a) and value == a for a in args):
            return value
        raise ConfigError(f"{where}={_show(value)}: must be one of {', '.join(_show(a) for a in args)}")
    if dataclasses.is_dataclass(kind):
        return _record(value, kind, where)
    if origin in (list, tuple) or kind in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}={_show(value)}: must be a list, e.g. [{_example(args)}]")
        item = args[0] if args else Any
        return [_value(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict or kind is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}={_show(value)}: must be a mapping of keys to values")
        item = args[1] if args else Any
        return {k: _value(v, item, _join(where, str(k))) for k, v in value.items()}
    if kind is Any:
        return value
    if value is None:
        raise ConfigError(f"{where} is null: it must be {_describe(kind)}")
    if kind is bool:
        if isinstance(value, bool):
            return value
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ConfigError(f"{where}={_show(value)}: must be a finite number")
            return float(value)
    elif kind is str:
        if isinstance(value, str):
            return value
    else:
        raise TypeError(f"schema type {kind!r} at {where} is not supported")
    raise ConfigError(f"{where}={_show(value)}: must be {_describe(kind)}")


def _record(value: Any, schema: type, where: str) -> Any:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where or 'the config'}={_show(value)}: must be a mapping of keys to values")
    fields = {f.name: f for f in dataclasses.fields(schema)}
    hints = typing.get_type_hints(schema, include_extras=True)
    for key in value:
        if key not in fields:
            near = difflib.get_close_matches(str(key), fields, n=1)
            takes = f"{where or 'the config'} takes {', '.join(fields)}"
            hint = f"did you mean {_join(where, near[0])}?" if near else takes
            raise ConfigError(f"unknown key {_join(where, str(key))}: {hint}")
    out = {}
    for name, f in fields.items():
        if name in value:
            if value[name] == "???":
                raise ConfigError(f"{_join(where, name)} is required (it is ???): set {_join(where, name)}=…")
            out[name] = _value(value[name], hints[name], _join(where, name))
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{_join(where, name)} is missing: add {_join(where, name)}=…")
    try:
        return schema(**out)
    except ConfigError as err:  # a rule across keys (__post_init__, keys named within the node)
        raise ConfigError(f"{where}: {err}" if where else str(err)) from None


def _fits(value: Any, kind: Any) -> bool:
    """Whether ``value`` has the shape of ``kind`` (its bounds and contents aside)."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is Annotated:
        return _fits(value, args[0])
    if origin is Literal:
        return any(type(value) is type(a) and value == a for a in args)
    if dataclasses.is_dataclass(kind) or origin is dict or kind is dict:
        return isinstance(value, Mapping)
    if origin in (list, tuple) or kind in (list, tuple):
        return isinstance(value, (list, tuple))
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return kind is Any or isinstance(value, kind)


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return repr(value) if len(value) <= 60 else repr(value[:57] + "...")
    text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _example(args) -> str:
    return "1, 2" if args and args[0] is int else "…"


def _describe(kind: Any) -> str:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is Annotated:
        return " ".join([_describe(args[0]), *(str(r) for r in args[1:] if isinstance(r, Range))])
    if origin in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _describe(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(_show(a) for a in args)
    if origin in (list, tuple):
        return "a list"
    if origin is dict or dataclasses.is_dataclass(kind):
        return "a mapping"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(kind, str(kind))


def _msg(err: Exception) -> str:
    return " ".join(str(err).split("\n")[0].split())
