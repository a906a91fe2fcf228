"""Type checks for the RL configs, because their values come from hand-written YAML.

A YAML typo (`lr: "fast"`, `steps: 2.5`, `betas: 0.9`, `loss: ppo`) would otherwise surface as a
`TypeError` deep inside a comparison or the optimizer. `check_types(cfg)` runs first in each
config's `__post_init__` and names the key, the expected type and the value. It understands the
annotations these configs use: bool, int, float (an int is accepted and converted), str, `X | None`,
`tuple[float, ...]`-like fixed tuples, dicts and nested config dataclasses. `build(kind, raw, key)`
builds a nested config from a YAML mapping with the same kind of message for unknown keys.
Left out: general typing constructs (unions of several types, generics beyond these).
"""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any


class ConfigTypeError(TypeError, ValueError):
    """A config value of the wrong type (a ValueError too, so callers validating input catch one type)."""


def _name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _check(key: str, value: Any, tp: Any) -> Any:
    """`value` if it has type `tp` (ints converted to float where a float is expected), else raise."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return _check(key, value, rest[0])
        return value  # wider unions are left to the config's own checks
    if tp is Any:
        return value
    if tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif tp is str:
        ok = isinstance(value, str)
    elif origin is tuple:
        if not isinstance(value, (tuple, list)) or (args and args[-1] is not Ellipsis and len(value) != len(args)):
            raise ConfigTypeError(f"{key} must be a list of {len(args)} values ({', '.join(map(_name, args))}), "
                                  f"got {value!r} ({type(value).__name__})")
        elems = args[:1] * len(value) if args and args[-1] is Ellipsis else args
        return tuple(_check(f"{key}[{i}]", v, t) for i, (v, t) in enumerate(zip(value, elems)))
    elif origin is dict or tp is dict:
        ok = isinstance(value, dict)
    elif dataclasses.is_dataclass(tp):
        ok = isinstance(value, tp)
    else:
        return value
    if not ok:
        raise ConfigTypeError(f"{key} must be {_name(tp) if origin is None else _name(origin)}, "
                              f"got {value!r} ({type(value).__name__})")
    return value


def check_types(cfg: Any) -> None:
    """Check (and normalise: int -> float, list -> tuple) every field of a frozen config dataclass."""
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        checked = _check(f"{type(cfg).__name__}.{f.name}", value, hints[f.name])
        if checked is not value:
            object.__setattr__(cfg, f.name, checked)


def build(kind: type, raw: Any, key: str) -> Any:
    """`kind(**raw)` for a YAML mapping, with errors that name `key` (e.g. "loss")."""
    if isinstance(raw, kind):
        return raw
    if not isinstance(raw, dict):
        raise ConfigTypeError(f"{key} must be a mapping of {kind.__name__} fields "
                              f"({', '.join(f.name for f in dataclasses.fields(kind))}), "
                              f"got {raw!r} ({type(raw).__name__})")
    known = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"unknown {key} keys {unknown}; known: {sorted(known)}")
    return kind(**raw)
