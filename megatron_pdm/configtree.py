"""One typed parser for every config of the project: dataclasses in, clean errors out.

Every config section is a plain dataclass whose annotations are the schema (`int`, `float`,
`bool`, `str`, `X | None`, `Literal[...]`, `list[X]`, nested dataclasses). This module turns a
mapping (yaml, `--set a.b=c` overrides, JSON) into such a tree:

* values are converted by field type, once, here: `"inf"` and `"1e-3"` (which yaml leaves as
  strings) become floats for float fields, `"null"` / `None` is accepted only where the type
  admits None, an int field refuses 8.5 and `True`;
* every section validates its own values: `check_fields(self)` (called from each dataclass's
  `__post_init__`) checks `Literal` membership and basic types, so a section built directly in
  Python is checked exactly like one parsed from yaml; range rules stay in the section's own
  `__post_init__`;
* an unknown or misspelt key is an error that names it and lists the valid keys of its section,
  with a guess: the place of a key of that name in a nested section (`rollout.staleness`: did you
  mean `rollout.local.staleness`), else the closest valid keys (difflib);
  every error is a `ConfigError` whose message starts with the dotted key, and CLIs print it as
  one line without a traceback (`megatron_pdm.cli`).

A section may define `classmethod _from_mapping(cls, data, path)` to pre-process its mapping
(the loss section resolves `preset:` there) before the generic conversion runs, and list the
extra keys that hook accepts in `_config_aliases` (shown among the valid keys in errors).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, Union, get_args, get_origin

import yaml

__all__ = [
    "ConfigError",
    "apply_override",
    "check_fields",
    "check_positive",
    "convert",
    "from_mapping",
    "parse_override",
    "to_plain",
]


class ConfigError(ValueError):
    """A config value, key or combination a user can fix. The message names the dotted key."""


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_union(tp) -> bool:
    return get_origin(tp) in (Union, types.UnionType)


def _describe(tp) -> str:
    if tp is type(None):
        return "null"
    if _is_union(tp):
        return " or ".join(_describe(a) for a in get_args(tp))
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if dataclasses.is_dataclass(tp):
        return f"a mapping ({tp.__name__})"
    origin = get_origin(tp)
    if origin in (list, tuple):
        return f"a list of {_describe(get_args(tp)[0])}" if get_args(tp) else "a list"
    return getattr(tp, "__name__", str(tp))


_NULL_STRINGS = ("null", "none", "~", "")


def convert(value: Any, tp: Any, key: str) -> Any:
    """Converts `value` to annotation `tp`; raises ConfigError naming `key` otherwise."""
    if tp is Any:
        return value
    if _is_union(tp):
        args = get_args(tp)
        if type(None) in args and (value is None or (
                isinstance(value, str) and value.strip().lower() in _NULL_STRINGS)):
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return convert(value, arg, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}={value!r}: expected {_describe(tp)}")
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{key}={value!r}: expected null")
    origin = get_origin(tp)
    if origin is Literal:
        allowed = get_args(tp)
        if value in allowed and not (isinstance(value, bool) and not any(
                isinstance(a, bool) for a in allowed)):
            return value
        raise ConfigError(f"{key}={value!r}: expected one of {list(allowed)}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        return from_mapping(tp, value, key)
    if origin in (list, tuple):
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r}: expected {_describe(tp)}")
        (elem,) = get_args(tp)[:1] or (Any,)
        items = [convert(v, elem, f"{key}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}={value!r}: expected a mapping")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        raise ConfigError(f"{key}={value!r}: expected true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
        raise ConfigError(f"{key}={value!r}: expected an integer")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out = float(value)
        elif isinstance(value, str):
            try:
                out = float(value.strip())
            except ValueError:
                raise ConfigError(f"{key}={value!r}: expected a number") from None
        else:
            raise ConfigError(f"{key}={value!r}: expected a number")
        if math.isnan(out):
            raise ConfigError(f"{key}={value!r}: NaN is not a valid value")
        return out
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}={value!r}: expected a string")
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(f"{key}={value!r}: expected {_describe(tp)}")


def check_fields(obj: Any, path: str = "") -> None:
    """Validates every field of a dataclass instance against its annotation (types, Literals).

    Call it first in `__post_init__`. Values that need converting (a float given as the string
    "inf") are converted in place, so a section built in Python behaves like a parsed one.
    """
    prefix = f"{path}." if path else ""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        converted = convert(value, hints[f.name], prefix + f.name)
        if converted is not value:
            object.__setattr__(obj, f.name, converted)


def check_positive(section: str, obj: Any, *names: str, allow_zero: bool = False,
                   finite: bool = True) -> None:
    """The range rule of numeric fields: each of `names` (None skipped) is > 0 (>= 0 with
    `allow_zero`) and, unless `finite=False`, finite; a ConfigError names `section.name`."""
    for name in names:
        value = getattr(obj, name)
        if value is not None and finite and not math.isfinite(value):
            raise ConfigError(f"{section}.{name}={value!r} must be a finite number")
        if value is not None and (value < 0 if allow_zero else value <= 0):
            raise ConfigError(f"{section}.{name}={value!r} must be "
                              f"{'>= 0' if allow_zero else '> 0'}")


def _nested_places(cls, name: str, prefix: str, depth: int = 3) -> list[str]:
    """Dotted paths of the fields called `name` in the sections nested under `cls` (the schema
    walked `depth` levels down; `cls`'s own fields excluded)."""
    places: list[str] = []
    if depth == 0:
        return places
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if not (isinstance(tp, type) and dataclasses.is_dataclass(tp)):
            continue
        sub = f"{prefix}{f.name}."
        if any(g.name == name and g.init for g in dataclasses.fields(tp)):
            places.append(sub + name)
        places.extend(_nested_places(tp, name, sub, depth - 1))
    return places


def _unknown_hint(cls, key: str, prefix: str, valid: list[str]) -> str:
    """`; <key>: did you mean ...` for an unknown key: the nested sections' keys of that name
    (a key that lives in an engine's section), else the closest valid keys (a misspelling)."""
    near = _nested_places(cls, key, prefix) or [
        prefix + k for k in difflib.get_close_matches(key, [str(v) for v in valid], n=3)]
    return f"; {prefix}{key}: did you mean {' or '.join(near)}?" if near else ""


def from_mapping(cls, data: Any, path: str = ""):
    """Builds dataclass `cls` from a mapping, converting every value by its field type.

    Raises:
        ConfigError: not a mapping, unknown keys (the valid ones are listed), a value of the
            wrong type, or a rule of the section's `__post_init__` (prefixed with `path`).
    """
    where = path or "<root>"
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {data!r}")
    hook = getattr(cls, "_from_mapping", None)
    if hook is not None:
        data = hook(dict(data), path)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields), key=str)
    if unknown:
        prefix = f"{path}." if path else ""
        valid = sorted(set(fields) | set(getattr(cls, "_config_aliases", ())))
        hints = "".join(_unknown_hint(cls, str(k), prefix, valid) for k in unknown)
        raise ConfigError(
            f"unknown key(s) {[prefix + str(k) for k in unknown]}; valid keys of {where}: "
            f"{valid}{hints}")
    hints = _hints(cls)
    prefix = f"{path}." if path else ""
    kwargs = {name: convert(value, hints[name], prefix + name) for name, value in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError as err:
        if path and not str(err).startswith(path):
            raise ConfigError(f"{path}: {err}") from None
        raise
    except (ValueError, TypeError) as err:
        raise ConfigError(f"{where}: {err}") from None


def parse_override(item: str) -> tuple[list[str], Any]:
    """`"a.b.c=value"` -> (["a", "b", "c"], value parsed as a yaml scalar)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form dotted.key=value")
    key, raw = item.split("=", 1)
    parts = [p.strip() for p in key.strip().split(".")]
    if not all(parts):
        raise ConfigError(f"override {item!r}: empty key part")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw  # left as a string; the field type decides
    return parts, value


def apply_override(data: dict, item: str) -> None:
    """Applies one `dotted.key=value` override to a nested mapping in place.

    Keys are only checked against the schema when the tree is built (`from_mapping`), so an
    override of a misspelt key fails there with the valid keys listed.
    """
    parts, value = parse_override(item)
    node = data
    for i, p in enumerate(parts[:-1]):
        child = node.get(p)
        if child is None:
            child = node[p] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {'.'.join(parts[:i + 1])} is a value, "
                              "not a section")
        node = child
    node[parts[-1]] = value


def to_plain(obj: Any) -> Any:
    """A dataclass tree as plain dicts/lists (yaml-safe: yaml writes inf as .inf).

    A section may define `_to_mapping(self)` to control its own form (the loss section writes
    its preset name under `preset`).
    """
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        hook = getattr(obj, "_to_mapping", None)
        if hook is not None:
            return hook()
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    return obj
