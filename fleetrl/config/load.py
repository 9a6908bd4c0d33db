"""YAML + dotted overrides -> a typed, frozen RunConfig. Every error names the key path and the fix."""
from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from fleetrl.config.frozen import FrozenDict, deep_freeze
from fleetrl.config.schema import RunConfig
from fleetrl.errors import UserError


class ConfigError(UserError, ValueError):
    """A config the user wrote cannot be used; the message says which key and what to change."""


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> RunConfig:
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist; pass the path of a YAML run config "
                              f"(see examples/quickstart.yaml)")
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML: {e}") from e
        if not isinstance(raw, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of sections (model:, data:, ...)")
    for item in overrides:
        apply_override(raw, item)
    return build(RunConfig, raw, "")


def apply_override(raw: dict[str, Any], item: str) -> None:
    """`a.b.c=value` (value parsed as YAML, so `1e-6`, `true`, `[1,2]` and `{a: 1}` work)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not KEY=VALUE (e.g. actor.optim.lr=1e-6)")
    key, _, text = item.partition("=")
    try:
        value = yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {item!r}: value is not valid YAML: {e}") from e
    if isinstance(value, dict) and len(value) == 1 and None in value.values() and text.rstrip().endswith(":"):
        value = text.strip()  # `model.path=tiny:` means the string "tiny:", not the mapping {tiny: null}
    node = raw
    parts = key.strip().split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = value


def to_dict(cfg: Any) -> Any:
    """A RunConfig (or any part) as plain YAML-safe data."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, Mapping):
        return {k: to_dict(v) for k, v in cfg.items()}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    return cfg


def dump_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


# --------------------------------------------------------------------------------------- typed building
def build(cls: type, raw: Any, where: str) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where or 'config'}: expected a section (mapping), got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in raw:
        if key not in names:
            raise ConfigError(_unknown_key(where, key, names))
    kwargs = {k: _convert(hints[k], v, _join(where, k)) for k, v in raw.items()}
    return cls(**kwargs)


def _convert(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return deep_freeze(value)
    if origin is typing.Literal:
        return _choice(args, value, where)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _convert(arg, value, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{where}: {value!r} matches none of {tp}")
    if dataclasses.is_dataclass(tp):
        return build(tp, value, where)
    if origin in (dict, collections.abc.Mapping):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        ktp, vtp = args
        return FrozenDict({_convert(ktp, k, where): _convert(vtp, v, f"{where}.{k}") for k, v in value.items()})
    if origin is tuple:
        if isinstance(value, (str, int, float)):
            value = [value]  # `stop: "\n"` means one stop string
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v, where) for v in value)
        if len(args) != len(value):
            raise ConfigError(f"{where}: expected {len(args)} values, got {value!r}")
        return tuple(_convert(a, v, where) for a, v in zip(args, value))
    return _scalar(tp, value, where)


def _scalar(tp: type, value: Any, where: str) -> Any:
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:  # YAML 1.1 reads `1e-6` as a string; accept it
            return float(value)
        except ValueError:
            pass
    if tp is int and isinstance(value, bool):
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if isinstance(value, tp):
        return value
    raise ConfigError(f"{where}: expected {tp.__name__}, got {type(value).__name__} {value!r}")


def _choice(choices: tuple, value: Any, where: str) -> Any:
    """A `Literal[...]` field: the Literal is the one list of allowed values."""
    if value in choices:
        return value
    guess = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
    hint = f"; did you mean {guess[0]!r}?" if guess else ""
    raise ConfigError(f"{where}: unknown value {value!r}{hint} (choose from: {', '.join(map(str, choices))})")


def choices_of(cls: type, name: str) -> tuple:
    """Allowed values of a Literal field (for messages elsewhere that list them)."""
    return typing.get_args(typing.get_type_hints(cls)[name])


def _unknown_key(where: str, key: str, names: list[str]) -> str:
    guess = difflib.get_close_matches(str(key), names, n=1)
    hint = f"; did you mean {_join(where, guess[0])!r}?" if guess else ""
    return f"unknown config key {_join(where, str(key))!r}{hint} (valid keys here: {', '.join(names)})"


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key
