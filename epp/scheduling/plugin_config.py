"""Typed, validated plugin parameters: a bad scheduler YAML fails at load, with
the config path of the mistake, never at the first request.

Each plugin declares a slots dataclass of its parameters (camelCase names, as
the reference EPP's configs use); `parse_params` checks the raw mapping
against it: unknown keys, wrong types and out-of-range values are errors that
name the path, e.g. `profiles.default.scorers[0].lruCapacityPerServer`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

P = TypeVar("P")


class ConfigError(ValueError):
    """A scheduler config mistake; the message starts with its path."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path


@dataclasses.dataclass(slots=True, frozen=True)
class NoParams:
    pass


def _check_value(path: str, want: Any, v: Any, meta: dict[str, Any]) -> Any:
    if want in ("int", int):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(path, f"must be an integer, got {v!r}")
    elif want in ("float", float):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(path, f"must be a number, got {v!r}")
        v = float(v)
    elif want in ("bool", bool):
        if not isinstance(v, bool):
            raise ConfigError(path, f"must be true or false, got {v!r}")
    elif want in ("str", str):
        if not isinstance(v, str):
            raise ConfigError(path, f"must be a string, got {v!r}")
    lo, hi, choices = meta.get("min"), meta.get("max"), meta.get("choices")
    if lo is not None and v < lo:
        raise ConfigError(path, f"must be >= {lo}, got {v!r}")
    if hi is not None and v > hi:
        raise ConfigError(path, f"must be <= {hi}, got {v!r}")
    if choices is not None and v not in choices:
        raise ConfigError(path, f"must be one of {list(choices)}, got {v!r}")
    return v


def parse_params(cls: type[P], raw: dict[str, Any], path: str,
                 ignore: tuple[str, ...] = ("type",)) -> P:
    """`raw` (one plugin's YAML mapping) as an instance of `cls`, or ConfigError."""
    if not isinstance(raw, dict):
        raise ConfigError(path, f"must be a mapping, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(k for k in raw if k not in fields and k not in ignore)
    if unknown:
        takes = ", ".join(fields) or "no parameters"
        raise ConfigError(f"{path}.{unknown[0]}", f"unknown parameter (it takes {takes})")
    values = {name: _check_value(f"{path}.{name}", f.type, raw[name], dict(f.metadata))
              for name, f in fields.items() if name in raw}
    return cls(**values)


def param(default: Any, *, min: Any = None, max: Any = None, choices: Any = None,
          doc: str = "") -> Any:
    """A dataclass field with its bounds, for a plugin's params class."""
    return dataclasses.field(default=default,
                             metadata={"min": min, "max": max, "choices": choices, "doc": doc})
