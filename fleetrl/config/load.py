"""YAML + dotted overrides -> a typed, frozen RunConfig. Every error names the key path and the fix.

Secrets: a string value `${env:NAME}` or `${file:PATH}` is read from that environment variable or file at load
time, so config files and argv never hold them. Every dump of a config (`dump_yaml`, `redacted_dict`) replaces
the value of any key ending in token/secret/password/api_key with "***".
"""
from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import os
import re
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
    return build(RunConfig, resolve_refs(raw, ""), "")


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


SECRET_SUFFIXES = ("token", "secret", "password", "api_key")
REDACTED = "***"
_REF = re.compile(r"^\$\{(env|file):([^}]+)\}$")


def is_secret_key(name: Any) -> bool:
    """`remote_token`, `WANDB_API_KEY`, `db_password`... (but not `max_new_tokens`: suffix, not substring)."""
    return isinstance(name, str) and name.lower().endswith(SECRET_SUFFIXES)


def redact_secrets(data: Any) -> Any:
    """Plain data (from `to_dict` or YAML) with every set secret-named value replaced by "***"; None stays None
    so a dump still shows whether a secret was given."""
    if isinstance(data, Mapping):
        return {k: REDACTED if is_secret_key(k) and v not in (None, "") else redact_secrets(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [redact_secrets(v) for v in data]
    return data


def redacted_dict(cfg: Any) -> Any:
    """`to_dict(cfg)` with secrets redacted: what trackers (W&B, MLflow) and any other record may receive."""
    return redact_secrets(to_dict(cfg))


def dump_yaml(cfg: RunConfig, *, redact: bool = True) -> str:
    """The config as YAML; secrets redacted unless `redact=False` (only for a process that needs them)."""
    data = redacted_dict(cfg) if redact else to_dict(cfg)
    return yaml.safe_dump(data, sort_keys=False)


def redact_yaml_text(text: str) -> str:
    """A config.yaml written by any fleetrl version, re-dumped with its secrets redacted (for diffs and logs)."""
    return yaml.safe_dump(redact_secrets(yaml.safe_load(text) or {}), sort_keys=False)


def write_private(path: str | Path, text: str) -> None:
    """Writes `text` to `path` readable by its owner only (0600), also when the file existed with wider bits."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(text)


def write_config(path: str | Path, cfg: RunConfig) -> None:
    """config.yaml of a run or checkpoint: redacted, and 0600 in case a secret hides under another key name."""
    write_private(path, dump_yaml(cfg))


def resolve_refs(raw: Any, where: str) -> Any:
    """Replaces `${env:NAME}` / `${file:PATH}` strings by the variable's value / the file's text (one trailing
    newline stripped). A missing variable or file names the key and how to provide it."""
    if isinstance(raw, dict):
        return {k: resolve_refs(v, _join(where, str(k))) for k, v in raw.items()}
    if isinstance(raw, list):
        return [resolve_refs(v, f"{where}[{i}]") for i, v in enumerate(raw)]
    m = _REF.match(raw) if isinstance(raw, str) else None
    if m is None:
        return raw
    kind, name = m.group(1), m.group(2).strip()
    if kind == "env":
        if name not in os.environ:
            raise ConfigError(f"{where}: {raw} names environment variable {name}, which is not set; export "
                              f"{name}=... before running (with `fleetrl submit`, also --env {name})")
        return os.environ[name]
    p = Path(name).expanduser()
    if not p.is_file():
        raise ConfigError(f"{where}: {raw} names file {str(p)!r}, which does not exist; write the secret "
                          f"there (chmod 600) or use ${{env:NAME}}")
    return p.read_text().removesuffix("\n")


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
