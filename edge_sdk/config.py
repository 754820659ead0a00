"""Typed configuration from TOML files and `--set key=value` overrides; bad keys are named.

Every settings object is a dataclass. `from_mapping` builds one from a plain mapping, coercing
strings from the command line to the field's type and rejecting unknown keys by name, so a
typo in a config file is an error rather than a silently ignored default.
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")


class ConfigError(ValueError):
    """A configuration value or key is invalid; the message names the key."""


def load_toml(path: str | Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path}: {exc}") from None


def parse_assignments(pairs: list[str] | None) -> dict[str, str]:
    """`["lr=0.1", "variant=in"]` -> `{"lr": "0.1", "variant": "in"}`."""
    result: dict[str, str] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set expects key=value, got {pair!r}")
        result[key.strip().replace("-", "_")] = value.strip()
    return result


def coerce(key: str, value: Any, annotation: Any) -> Any:
    """`value` (from TOML or, as a string, from the command line) as type `annotation`; a
    ConfigError naming `key` when it is not one."""
    origin = typing.get_origin(annotation)
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
            return None
        return coerce(key, value, args[0])
    if origin is typing.Literal:
        if value not in typing.get_args(annotation):
            raise ConfigError(f"{key} must be one of {list(typing.get_args(annotation))}, got {value!r}")
        return value
    if origin in (tuple, list):
        items = value.split(",") if isinstance(value, str) else list(value)
        return origin(coerce(key, v, args[0]) if args else v for v in items)
    try:
        if annotation in (int, float) and isinstance(value, bool):
            raise ValueError(value)
        if annotation is bool:
            if isinstance(value, str):
                if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(value)
                return value.lower() in ("true", "1", "yes")
            return bool(value)
        if annotation is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(value)
        if annotation is float:
            return float(value)
        if annotation is str:
            return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key} must be {annotation.__name__}, got {value!r}") from None
    return value


def from_mapping(cls: type[T], mapping: Mapping[str, Any], *, where: str = "config", base: T | None = None) -> T:
    """Build dataclass `cls` from `mapping` (on top of `base`), naming any unknown or bad key."""
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    values = dataclasses.asdict(base) if base is not None else {}
    for raw_key, value in mapping.items():
        key = raw_key.replace("-", "_")
        if key not in fields:
            raise ConfigError(f"unknown key {raw_key!r} in {where}; known keys: {', '.join(sorted(fields))}")
        values[key] = coerce(f"{where}.{key}", value, hints[key])
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"{where}: {exc}") from None


def to_plain(obj: Any) -> dict[str, Any]:
    """A dataclass as a dict of plain values (msgpack- and JSON-safe)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(obj).items()}
