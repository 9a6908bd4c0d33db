"""`fleetrl sweep` and `fleetrl report`: each parses its flags and calls the library; `register(app)` adds them."""
from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

console = Console()
err_console = Console(stderr=True)


def _fail(e: Exception) -> None:
    err_console.print(f"[bold red]error:[/] {e}", soft_wrap=True, highlight=False)
    raise typer.Exit(2)


def sweep(
    config: str | None = typer.Argument(None, help="Run config YAML (not needed with --resume)."),
    overrides: list[str] | None = typer.Argument(None, help="key=value overrides for every run."),
    seeds: str | None = typer.Option(None, "--seeds", help="Comma-separated seeds, e.g. 42,1337,2024."),
    grid: list[str] | None = typer.Option(None, "--grid", help="KEY=V1,V2 (repeatable): one run per value "
                                                                  "combination and seed."),
    gpus_per_run: int | None = typer.Option(None, "--gpus-per-run", help="GPUs per run (default: what the "
                                               "placement needs); runs get disjoint CUDA_VISIBLE_DEVICES."),
    cpus_per_run: int | None = typer.Option(None, "--cpus-per-run", help="CPU cores per run (pinned with "
                                               "taskset; also the run's Ray num_cpus)."),
    max_parallel: int | None = typer.Option(None, "--max-parallel", help="Runs at once (default: as many "
                                               "as the resources hold); the rest wait in a queue."),
    out: Path | None = typer.Option(None, "--out", help="Sweep directory (default sweeps/<config>-<time>)."),
    retries: int = typer.Option(0, "--retries", help="Restarts of a dead or stalled run from its last checkpoint."),
    stall_s: float = typer.Option(1800.0, "--stall-s", help="A run with no new metrics line for this long is "
                                  "stalled (ended, reported, retried)."),
    grace_s: float = typer.Option(10.0, "--grace-s", help="Seconds between SIGTERM and SIGKILL when stopping."),
    resume: Path | None = typer.Option(None, "--resume", help="Continue the sweep in this directory: "
                                          "unfinished runs resume from their checkpoints, finished ones are skipped."),
    live: bool | None = typer.Option(None, "--live/--plain", help="Live table or plain lines (default: live "
                                        "on a terminal)."),
) -> None:
    """Run CONFIG for every seed × grid value, side by side on disjoint GPUs/cores; Ctrl-C stops every run."""
    from fleetrl.config import ConfigError
    from fleetrl.sweep import (
        Manifest,
        Sweep,
        SweepOptions,
        new_sweep,
        parse_grid,
        parse_seeds,
    )

    opts = SweepOptions(gpus_per_run=gpus_per_run, cpus_per_run=cpus_per_run, max_parallel=max_parallel,
                        retries=retries, stall_s=stall_s, grace_s=grace_s, live=live)
    try:
        if resume is not None:
            if config or seeds or grid:
                raise ValueError("--resume takes the config, seeds and grid from the sweep's manifest; drop "
                                 "CONFIG/--seeds/--grid (resource flags and --retries may be given)")
            sweep_dir, manifest = resume, Manifest.load(resume)
        else:
            if not config or not seeds:
                raise ValueError("give CONFIG and --seeds, e.g. fleetrl sweep examples/quickstart.yaml --seeds 42,1337")
            sweep_dir, manifest = new_sweep(config, parse_seeds(seeds), parse_grid(list(grid or [])),
                                            list(overrides or []), out)
        code = Sweep(sweep_dir, manifest, opts, console).run()
    except (ConfigError, ValueError, FileNotFoundError, FileExistsError) as e:
        _fail(e)
    console.print(f"report: fleetrl report {sweep_dir}")
    raise typer.Exit(code)


def report(
    dirs: list[Path] = typer.Argument(..., help="Run directories, sweep directories, or both."),
    out: Path | None = typer.Option(None, "--out", help="Output folder (default: DIR/report for one DIR)."),
    compare: tuple[str, str] | None = typer.Option(None, "--compare", help="Two group labels as printed in "
                                                      "the table: --compare advantage=rloo advantage=grpo gives "
                                                      "A - B with its 95% CI (Welch)."),
) -> None:
    """Curves (each seed + mean ± 95% CI), final/best validation reward per group, PNGs and one HTML page."""
    try:
        from fleetrl.report import build_report
    except ImportError as e:
        _fail(ImportError(f"`fleetrl report` needs matplotlib and scipy ({e}); pip install 'fleetrl[report]'"))
    target = out or (dirs[0] / "report" if len(dirs) == 1 else Path("report"))
    try:
        result = build_report(list(dirs), target, compare=tuple(compare) if compare else None)
    except (ValueError, FileNotFoundError) as e:
        _fail(e)
    for w in result.warnings:
        console.print(f"[yellow]warning:[/] {w}", soft_wrap=True, highlight=False)
    console.print(result.text_summary, highlight=False, soft_wrap=True)
    console.print(f"wrote {result.html} and {len(result.pngs)} PNG(s) in {target}")


def register(app: typer.Typer) -> None:
    app.command()(sweep)
    app.command()(report)
