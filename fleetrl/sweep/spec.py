"""What a sweep runs: seeds × grid values expanded into named runs, each a list of `key=value` overrides.

A run's seed and grid values are plain overrides of `fleetrl train`, so the run's own config.yaml records
them; the sweep adds nothing a reader of one run directory would have to look up elsewhere.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field

# Keys the sweep owns for every run; a grid over them would make two runs share a directory or a seed.
_RESERVED = ("trainer.seed", "trainer.output_dir", "trainer.resume")


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    name: str
    """Directory name under the sweep dir, e.g. `algorithm.advantage=rloo,seed=42`."""
    seed: int
    grid: dict[str, str] = field(default_factory=dict)
    """Grid key -> value as typed on the command line (the config loader parses it like any override)."""

    def overrides(self) -> list[str]:
        """The overrides that make this run differ from its siblings (seed and grid values)."""
        return [f"{k}={v}" for k, v in self.grid.items()] + [f"trainer.seed={self.seed}"]


def parse_seeds(text: str) -> list[int]:
    """`42,1337` -> [42, 1337]; duplicates are an error since they would run the same thing twice."""
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--seeds {text!r}: expected comma-separated integers, e.g. --seeds 42,1337") from None
    if not seeds:
        raise ValueError("--seeds is empty: give at least one seed, e.g. --seeds 42")
    dupes = sorted({s for s in seeds if seeds.count(s) > 1})
    if dupes:
        raise ValueError(f"--seeds {text!r}: seed(s) {dupes} appear more than once; list each seed once")
    return seeds


def parse_grid(items: list[str]) -> dict[str, list[str]]:
    """`["algorithm.advantage=grpo,rloo"]` -> {"algorithm.advantage": ["grpo", "rloo"]} (keys in given order)."""
    grid: dict[str, list[str]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        key = key.strip()
        if not sep or not key or not values:
            raise ValueError(f"--grid {item!r}: expected KEY=V1,V2,..., e.g. --grid algorithm.advantage=grpo,rloo")
        if key in _RESERVED:
            raise ValueError(f"--grid {item!r}: {key} is set by the sweep for each run; "
                             f"use --seeds for seeds and --out for directories")
        if key in grid:
            raise ValueError(f"--grid {key} is given twice; put all its values in one flag: {key}=A,B,C")
        vals = [v.strip() for v in values.split(",")]
        if any(not v for v in vals) or len(set(vals)) != len(vals):
            raise ValueError(f"--grid {item!r}: values must be non-empty and distinct")
        grid[key] = vals
    return grid


def expand(seeds: list[int], grid: dict[str, list[str]]) -> list[RunSpec]:
    """Every grid combination × every seed. Seed-major order, so a sweep that is cut short has whole
    replicates of every setting rather than every seed of the first setting."""
    keys = list(grid)
    combos = list(itertools.product(*(grid[k] for k in keys))) or [()]
    # Short names (last key part) unless two keys share it, e.g. actor.optim.lr and critic.optim.lr.
    short = len({k.rsplit(".", 1)[-1] for k in keys}) == len(keys)
    runs = []
    for seed in seeds:
        for combo in combos:
            values = dict(zip(keys, combo))
            runs.append(RunSpec(name=run_name(values, seed, short), seed=seed, grid=values))
    names = [r.name for r in runs]
    if len(set(names)) != len(names):
        raise ValueError("two grid values map to the same run directory name after removing characters other "
                         "than letters, digits and ._=,+-; make the values differ in those characters")
    return runs


def run_name(grid: dict[str, str], seed: int, short: bool = True) -> str:
    """A readable directory name; characters a shell or filesystem would trip on become `_`."""
    parts = [f"{k.rsplit('.', 1)[-1] if short else k}={v}" for k, v in grid.items()] + [f"seed={seed}"]
    return re.sub(r"[^A-Za-z0-9._=,+-]", "_", ",".join(parts))[:200]
