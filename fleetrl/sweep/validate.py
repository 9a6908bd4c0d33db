"""Checks a sweep before anything exists on disk: every grid key is a config key, and every grid point loads and
derives a plan exactly as `fleetrl train` would, so a typo fails in a second instead of hours into the sweep."""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fleetrl.config import ConfigError, check_plan, load_config
from fleetrl.config.schema import RunConfig
from fleetrl.envs.check import check_env_config
from fleetrl.sweep.spec import RunSpec


def run_config(config: str | Path, overrides: list[str]) -> RunConfig:
    """The config of one run of a sweep, validated like `fleetrl train` validates it (config + plan)."""
    cfg = load_config(config, overrides)
    if cfg.cluster.address is not None:
        raise ConfigError(f"cluster.address={cfg.cluster.address}: `fleetrl sweep` starts a local Ray per run "
                          f"on this machine; remove cluster.address (or the override) to sweep here")
    check_plan(cfg)
    check_env_config(cfg.rollout.env)
    return cfg


def validate_points(config: Path, overrides: list[str], specs: list[RunSpec]) -> list[RunConfig]:
    """Each run's config, in `specs` order; a ConfigError names the grid point whose values are wrong."""
    load_config(config, overrides)  # a bad base override is the user's flag, not any grid point's
    cfgs = []
    for spec in specs:
        try:
            cfgs.append(run_config(config, [*overrides, *spec.overrides()]))
        except ConfigError as e:
            if not spec.grid or _fails_alike(config, overrides, e):
                raise  # the base config or its overrides are wrong, whatever the grid says
            point = ",".join(f"{k}={v}" for k, v in spec.grid.items())
            raise ConfigError(f"--grid point {point} (run {spec.name}): {e}; fix or drop that value in "
                              f"--grid") from None
    return cfgs


def _fails_alike(config: Path, overrides: list[str], error: ConfigError) -> bool:
    """Whether the base config (no grid values) fails with the same message as a grid point did."""
    try:
        run_config(config, overrides)
    except ConfigError as base:
        return str(base) == str(error)
    return False


def check_grid_keys(grid: dict[str, list[str]]) -> None:
    """Every --grid key must name a config key; an unknown one gets the full dotted key when its last part is
    the last part of exactly one key of the schema (`advantage` -> `algorithm.advantage`)."""
    for key, values in grid.items():
        if _is_key(RunConfig, key.split(".")):
            continue
        flag = f"--grid {key}={','.join(values)}"
        leaf = key.rsplit(".", 1)[-1]
        matches = [k for k in schema_keys(RunConfig) if k.rsplit(".", 1)[-1] == leaf]
        if len(matches) == 1:
            hint = f"did you mean {matches[0]!r}?"
        elif matches:
            hint = f"{leaf!r} is in {', '.join(matches)}: give the full dotted key"
        else:
            guess = difflib.get_close_matches(key, schema_keys(RunConfig), n=1)
            hint = f"did you mean {guess[0]!r}?" if guess else "see `fleetrl config show CONFIG` for the keys"
        raise ConfigError(f"{flag}: unknown config key {key!r}; {hint}")


def schema_keys(cls: type, prefix: str = "") -> list[str]:
    """Dotted paths of the leaves of a config dataclass (a section's mapping of names counts as one leaf)."""
    keys = []
    for f in dataclasses.fields(cls):
        tp = _section(typing.get_type_hints(cls)[f.name])
        path = f"{prefix}{f.name}"
        keys += schema_keys(tp, path + ".") if tp is not None else [path]
    return keys


def _is_key(cls: type, parts: list[str]) -> bool:
    hints = typing.get_type_hints(cls)
    if parts[0] not in hints:
        return False
    if len(parts) == 1:
        return True
    tp = hints[parts[0]]
    section = _section(tp)
    if section is not None:
        return _is_key(section, parts[1:])
    return _open(tp)  # below a mapping or an Any the names are the user's (pools.main, env.kwargs.x)


def _section(tp: Any) -> type | None:
    """The dataclass behind a field type (`LoraConfig | None` -> LoraConfig), else None."""
    args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    found = [a for a in args if dataclasses.is_dataclass(a)]
    return found[0] if found else None


def _open(tp: Any) -> bool:
    args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    return any(a is Any or typing.get_origin(a) in (dict, Mapping) for a in args)
