"""Helpers for component config classes (attrs) and strict, key-precise validation."""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from typing import Any, Literal, Union, get_args, get_origin

import attrs

from eblvm_core.errors import ConfigError
from eblvm_core.registry import did_you_mean, option_default


def option(default: Any = attrs.NOTHING, help: str = "", validator: Any = None, **kw: Any) -> Any:
    """An attrs field with a help text (shown by ``eblvm plugins``)."""
    if isinstance(default, (list, dict)):
        value = default
        kw["factory"] = lambda: type(value)(value)
        default = attrs.NOTHING
    return attrs.field(default=default, validator=validator, metadata={"help": help}, **kw)


def positive(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    """Validator for value > 0; for a list, every item (``[64, 64]`` widths)."""
    for item in value if isinstance(value, (list, tuple)) else [value]:
        if item is not None and not item > 0:
            raise ValueError(f"must be > 0, got {value}")


def non_negative(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    """Validator for value >= 0; for a list, every item."""
    for item in value if isinstance(value, (list, tuple)) else [value]:
        if item is not None and not item >= 0:
            raise ValueError(f"must be >= 0, got {value}")


def in_range(low: float, high: float) -> Callable[[Any, attrs.Attribute, Any], None]:
    """Validator for low <= value <= high."""

    def check(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value is not None and not low <= value <= high:
            raise ValueError(f"must be in [{low}, {high}], got {value}")

    return check


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


INT_LIMIT = 2**63  # torch and the OS take 64-bit signed integers


def coerce(value: Any, tp: Any) -> Any:
    """Check ``value`` (from TOML) against the annotation ``tp``; ints widen to floats only.

    Integers must fit in 64 bits (|n| < 2^63), floats must be finite and strings hold no NUL
    byte: nothing downstream (torch, the OS) accepts otherwise.
    """
    origin, args = get_origin(tp), get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg)
            except (TypeError, ValueError) as exc:
                errors.append(str(exc))
        raise TypeError(" or ".join(errors))
    if origin is Literal:
        if value in args and type(value) is type(args[args.index(value)]):
            return value
        choices = ", ".join(repr(a) for a in args)
        raise ValueError(f"must be one of {choices}, got {value!r}{did_you_mean(str(value), [str(a) for a in args])}")
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if not -INT_LIMIT <= value < INT_LIMIT:
                raise ValueError(f"must fit in 64 bits (|n| < 2^63), got {value}")
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ValueError(f"must be a finite number, got {value}")
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            if "\x00" in value:
                raise ValueError(f"must not contain a NUL byte, got {value!r}")
            return value
    elif origin in (list, tuple) or tp in (list, tuple):
        if isinstance(value, (list, tuple)):
            if not args:
                return list(value)
            if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
                if len(value) != len(args):
                    raise ValueError(f"must have {len(args)} items, got {len(value)}")
                return tuple(coerce(v, a) for v, a in zip(value, args))
            items = [coerce(v, args[0]) for v in value]
            return tuple(items) if origin is tuple else items
    elif origin is dict or tp is dict:
        if isinstance(value, dict):
            return dict(value)
    else:
        raise TypeError(f"unsupported config type {tp!r}")
    raise TypeError(f"must be {_type_name(tp)}, got {type(value).__name__} {value!r}")


def structure(cls: type, values: dict[str, Any], section: str) -> Any:
    """Build the attrs config ``cls`` from TOML ``values``; errors name the section and key, every
    bad key at once (unknown keys, wrong values, missing required keys, in the order written:
    ``ConfigError.combine``)."""
    attrs.resolve_types(cls)
    fields = {f.name: f for f in attrs.fields(cls)}
    errors = []
    kwargs = {}
    for key, value in values.items():
        field = fields.get(key)
        if field is None:
            hint = did_you_mean(key, list(fields))
            valid = ", ".join(fields) or "none"
            errors.append(ConfigError(section, key, f"unknown key{hint}; valid keys: {valid}"))
            continue
        try:
            kwargs[key] = coerce(value, field.type)
            if field.validator is not None:
                field.validator(None, field, kwargs[key])
        except (TypeError, ValueError) as exc:
            errors.append(ConfigError(section, key, str(exc)))
    missing = [f.name for f in fields.values() if f.default is attrs.NOTHING and f.name not in values]
    errors += [ConfigError(section, name, "required key is missing") for name in missing]
    if errors:
        raise ConfigError.combine(errors)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(section, None, str(exc)) from None


def describe(cls: type) -> list[tuple[str, str, str, str]]:
    """(name, type, default, help) of each field of a config class."""
    attrs.resolve_types(cls)
    rows = []
    for f in attrs.fields(cls):
        default = option_default(f)
        default = "(required)" if default is attrs.NOTHING else repr(default)
        rows.append((f.name, _type_name(f.type), default, f.metadata.get("help", "")))
    return rows
