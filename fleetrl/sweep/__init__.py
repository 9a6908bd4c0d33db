"""`fleetrl sweep`: seeds × grid values as isolated runs on disjoint resources of one machine, health-checked,
retried from checkpoints, stopped cleanly. `new_sweep` writes the manifest; `Sweep(...).run()` runs it."""
from __future__ import annotations

import shutil
import time
from pathlib import Path

from fleetrl.config import load_config
from fleetrl.sweep.manifest import Manifest, RunRecord
from fleetrl.sweep.runner import Sweep, SweepOptions
from fleetrl.sweep.spec import RunSpec, expand, parse_grid, parse_seeds

__all__ = ["Manifest", "RunRecord", "RunSpec", "Sweep", "SweepOptions", "expand", "new_sweep", "parse_grid",
           "parse_seeds"]


def new_sweep(config: str, seeds: list[int], grid: dict[str, list[str]], overrides: list[str],
              out: str | Path | None) -> tuple[Path, Manifest]:
    """Creates the sweep dir with a copy of the base config and a manifest of queued runs."""
    src = Path(config)
    if not src.is_file():
        raise FileNotFoundError(f"config file {config!r} does not exist; pass a YAML run config "
                                f"(see examples/quickstart.yaml)")
    specs = expand(seeds, grid)
    for spec in specs:  # a typo in a key or value fails here, before any directory or run exists
        load_config(src, [*overrides, *spec.overrides()])
    sweep_dir = Path(out) if out else Path("sweeps") / f"{src.stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    if (sweep_dir / "sweep.json").exists():
        raise FileExistsError(f"{sweep_dir} already holds a sweep; continue it with `fleetrl sweep --resume "
                              f"{sweep_dir}` or pass another --out")
    sweep_dir.mkdir(parents=True, exist_ok=True)
    base = sweep_dir / "base_config.yaml"
    shutil.copyfile(src, base)
    runs = [RunRecord(name=s.name, seed=s.seed, grid=s.grid) for s in specs]
    manifest = Manifest(config=str(base.resolve()), overrides=list(overrides), seeds=seeds, grid=grid, runs=runs)
    manifest.save(sweep_dir)
    return sweep_dir, manifest
