"""`fleetrl sweep`: seeds × grid values as isolated runs on disjoint resources of one machine, health-checked,
retried from checkpoints, stopped cleanly. `start_sweep` checks and writes a new sweep and returns it ready to
`run()`; `new_sweep` only writes it; `Sweep(dir, Manifest.load(dir), ...)` continues one."""
from __future__ import annotations

import shutil
import time
from pathlib import Path

from rich.console import Console

from fleetrl.config.schema import RunConfig
from fleetrl.sweep.manifest import Manifest, ManifestError, RunRecord
from fleetrl.sweep.resources import Allocator
from fleetrl.sweep.runner import Sweep, SweepOptions, make_allocator
from fleetrl.sweep.spec import RunSpec, expand, parse_grid, parse_seeds
from fleetrl.sweep.validate import check_grid_keys, validate_points

__all__ = ["Manifest", "ManifestError", "RunRecord", "RunSpec", "Sweep", "SweepOptions", "expand", "new_sweep", "parse_grid",
           "parse_seeds", "start_sweep"]


def start_sweep(config: str, seeds: list[int], grid: dict[str, list[str]], overrides: list[str],
                out: str | Path | None, options: SweepOptions, console: Console) -> Sweep:
    """`new_sweep`, then the Sweep that runs it, reusing the checked configs and the resource probe (each grid
    point is loaded once and nvidia-smi asked once)."""
    sweep_dir, manifest, (cfgs, alloc) = _create(config, seeds, grid, overrides, out, options)
    return Sweep(sweep_dir, manifest, options, console, prepared=(cfgs, alloc))


def new_sweep(config: str, seeds: list[int], grid: dict[str, list[str]], overrides: list[str],
              out: str | Path | None, options: SweepOptions | None = None) -> tuple[Path, Manifest]:
    """Creates the sweep dir with a copy of the base config and a manifest of queued runs. Everything that can
    be checked up front is checked first (grid keys, every grid point's config and plan, and, given `options`,
    that one run fits this machine), so a mistake leaves no directory behind that a rerun would trip over."""
    sweep_dir, manifest, _ = _create(config, seeds, grid, overrides, out, options)
    return sweep_dir, manifest


def _create(config: str, seeds: list[int], grid: dict[str, list[str]], overrides: list[str],
            out: str | Path | None, options: SweepOptions | None
            ) -> tuple[Path, Manifest, tuple[list[RunConfig], Allocator | None]]:
    src = Path(config)
    if not src.is_file():
        raise FileNotFoundError(f"config file {config!r} does not exist; pass a YAML run config "
                                f"(see examples/quickstart.yaml)")
    check_grid_keys(grid)
    specs = expand(seeds, grid)
    cfgs = validate_points(src, overrides, specs)
    # Raises when one run needs more GPUs/cores than this machine has.
    alloc = make_allocator(cfgs, options) if options is not None else None
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
    return sweep_dir, manifest, (cfgs, alloc)
