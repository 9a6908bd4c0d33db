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


def load_config(path: str | Path | None, overrides: Sequence[str] = (), *, resolve: bool = True) -> RunConfig:
    """The typed run config of a YAML file plus dotted overrides. `resolve=False` keeps `${env:..}` / `${file:..}`
    references as written, for a check made where the secrets are not (a recipe printed on a laptop for a cluster
    whose head holds them)."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist; pass the path of a YAML run config "
                              f"(see examples/quickstart.yaml)")
        try:
            raw = load_yaml(_read_text(p)) or {}
        except DuplicateKeyError as e:
            raise ConfigError(f"{p}: {e}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML: {e}") from e
        if not isinstance(raw, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of sections (model:, data:, ...)")
    for item in overrides:
        apply_override(raw, item)
    return build(RunConfig, resolve_refs(raw, "") if resolve else raw, "")


def _read_text(p: Path) -> str:
    """The file's text; not-UTF-8 bytes (a UTF-16 export, a Latin-1 editor) name the file and the offset."""
    try:
        data = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"{p}: cannot be read ({e.strerror}); check the file's permissions") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        bom = " (it starts with a UTF-16 byte-order mark)" if data[:2] in (b"\xff\xfe", b"\xfe\xff") else ""
        raise ConfigError(f"{p}: not UTF-8 text{bom}: byte {data[e.start:e.start + 1]!r} at offset {e.start} "
                          f"cannot be decoded; a config file must be UTF-8 text, so re-save it as UTF-8") from None


class DuplicateKeyError(yaml.YAMLError):
    """A key given twice in one mapping: its dotted path and both (1-based) lines."""

    def __init__(self, key: str, first: int, second: int) -> None:
        super().__init__(key, first, second)
        self.key, self.first, self.second = key, first, second

    def __str__(self) -> str:
        return (f"key {self.key!r} is given twice (line {self.first} and line {self.second}); YAML would keep "
                f"only the second, so delete one or merge them")


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping: PyYAML would keep the last one silently, so a
    second `trainer:` section at the end of a file would drop every setting of the first."""

    def construct_document(self, node: yaml.Node) -> Any:
        # On the tree as parsed, before anything is built: building a mapping that merges an anchor (`<<: *a`)
        # rewrites the anchored mapping in place, so a check while building would see merged keys as repeats.
        _check_unique_keys(node)
        return super().construct_document(node)


MERGE_TAG = "tag:yaml.org,2002:merge"


def _check_unique_keys(root: yaml.Node) -> None:
    """Raises DuplicateKeyError for the first mapping (by its dotted path) that gives a key twice. Keys brought in
    by `<<: *anchor` may be given again: that is how a merge is overridden."""
    seen: set[int] = set()
    todo: list[tuple[yaml.Node, str]] = [(root, "")]
    while todo:
        node, where = todo.pop()
        if id(node) in seen:  # an alias reaches a node twice
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            first: dict[str, int] = {}
            for key_node, value in node.value:
                if key_node.tag == MERGE_TAG or not isinstance(key_node, yaml.ScalarNode):
                    continue
                line = key_node.start_mark.line + 1
                if key_node.value in first:
                    raise DuplicateKeyError(_join(where, key_node.value), first[key_node.value], line)
                first[key_node.value] = line
                todo.append((value, _join(where, key_node.value)))
        elif isinstance(node, yaml.SequenceNode):
            todo += [(v, f"{where}[{i}]") for i, v in enumerate(node.value)]


def load_yaml(text: str) -> Any:
    """yaml.safe_load that raises DuplicateKeyError for a key given twice in one mapping."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 — a SafeLoader subclass


def apply_override(raw: dict[str, Any], item: str) -> None:
    """`a.b.c=value` (value parsed as YAML, so `1e-6`, `true`, `[1,2]` and `{a: 1}` work)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not KEY=VALUE (e.g. actor.optim.lr=1e-6)")
    key, _, text = item.partition("=")
    try:
        value = load_yaml(text) if text != "" else ""
    except DuplicateKeyError as e:
        raise ConfigError(f"override {item!r}: key {e.key!r} is given twice in the value; keep one") from None
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
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in raw and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:  # else the dataclass's own TypeError, a traceback that names no key
        raise ConfigError(f"{where or 'config'}: {', '.join(_join(where, m) for m in missing)} must be set (this "
                          f"section has no default for {'it' if len(missing) == 1 else 'them'})")
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
        return _union(tp, args, value, where)
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


def _union(tp: Any, args: tuple, value: Any, where: str) -> Any:
    if value is None and type(None) in args:
        return None
    options = [a for a in args if a is not type(None)]
    if len(options) == 1 and not _is_leaf(options[0]):
        return _convert(options[0], value, where)  # a section's own error names the key inside it
    for arg in options:
        try:
            return _convert(arg, value, where)
        except ConfigError:
            pass
    raise ConfigError(f"{where}: expected {describe_type(tp)}, got {_got(value)}")


def _is_leaf(tp: Any) -> bool:
    """A scalar or Literal: its own error says no more than `describe_type` does."""
    return typing.get_origin(tp) is typing.Literal or tp in (int, float, str, bool)


_TYPE_WORDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false", type(None): "null"}


def describe_type(tp: Any) -> str:
    """A type as a person writes it in YAML: `float | Literal['auto']` -> "a number or 'auto'"."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        words = [describe_type(a) for a in args if a is not type(None)]
        words += ["null"] if type(None) in args else []  # null last: "an integer or null"
        return " or ".join(words)
    if origin is typing.Literal:
        return " or ".join(repr(a) for a in args)
    if origin in (dict, collections.abc.Mapping):
        return "a mapping"
    if origin is tuple:
        return "a list"
    if dataclasses.is_dataclass(tp):
        return "a section (mapping)"
    return _TYPE_WORDS.get(tp, getattr(tp, "__name__", str(tp)))


def _got(value: Any) -> str:
    return "null" if value is None else f"{type(value).__name__} {value!r}"


def _scalar(tp: type, value: Any, where: str) -> Any:
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:  # YAML 1.1 reads `1e-6` as a string; accept it
            return float(value)
        except ValueError:
            pass
    if tp is int and isinstance(value, bool):
        raise ConfigError(f"{where}: expected an integer, got {_got(value)}")
    if isinstance(value, tp):
        return value
    raise ConfigError(f"{where}: expected {describe_type(tp)}, got {_got(value)}")


def _choice(choices: tuple, value: Any, where: str) -> Any:
    """A `Literal[...]` field: the Literal is the one list of allowed values."""
    if value in choices:
        return value
    if isinstance(value, bool):
        # YAML 1.1 (PyYAML) reads a bare off/no/false as False and on/yes/true as True, so `actor.autocast: off`
        # (in a file or as a CLI override) arrives as False: take the choice the user spelled.
        spelled = [c for c in (("on", "yes", "true") if value else ("off", "no", "false")) if c in choices]
        if spelled:
            return spelled[0]
    guess = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
    hint = f"; did you mean {guess[0]!r}?" if guess else ""
    raise ConfigError(f"{where}: unknown value {value!r}{hint} (choose from: {', '.join(map(str, choices))})")


def _unknown_key(where: str, key: str, names: list[str]) -> str:
    guess = difflib.get_close_matches(str(key), names, n=1)
    hint = f"; did you mean {_join(where, guess[0])!r}?" if guess else ""
    return f"unknown config key {_join(where, str(key))!r}{hint} (valid keys here: {', '.join(names)})"


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key
