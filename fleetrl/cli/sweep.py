"""`fleetrl sweep` and `fleetrl report`: each parses its flags and calls the library; `register(app)` adds them."""
from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.text import Text

from fleetrl.cli.errors import report as report_error
from fleetrl.errors import UserError

console = Console()


def _fail(e: Exception) -> None:
    report_error(e)  # printed literally: messages quote paths and values full of [...] that rich reads as markup
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
        parse_grid,
        parse_seeds,
        start_sweep,
    )

    opts = SweepOptions(gpus_per_run=gpus_per_run, cpus_per_run=cpus_per_run, max_parallel=max_parallel,
                        retries=retries, stall_s=stall_s, grace_s=grace_s, live=live)
    try:
        if resume is not None:
            if config or seeds or grid:
                raise ValueError("--resume takes the config, seeds and grid from the sweep's manifest; drop "
                                 "CONFIG/--seeds/--grid (resource flags and --retries may be given)")
            run = Sweep(resume, Manifest.load(resume), opts, console)
        else:
            if not config or not seeds:
                raise ValueError("give CONFIG and --seeds, e.g. fleetrl sweep examples/quickstart.yaml --seeds 42,1337")
            # opts: the resources are checked before the sweep directory exists (a rerun must not find it).
            run = start_sweep(config, parse_seeds(seeds), parse_grid(list(grid or [])), list(overrides or []), out,
                              opts, console)
        code = run.run()
    except (UserError, ConfigError, ValueError, FileNotFoundError, FileExistsError) as e:
        _fail(e)
    console.print(f"report: fleetrl report {run.dir}")
    raise typer.Exit(code)


def report(
    dirs: list[Path] = typer.Argument(..., help="Run directories, sweep directories, or both."),
    out: Path | None = typer.Option(None, "--out", help="Output folder (default: DIR/report for one DIR)."),
    # One label per flag (a label holds commas and '=' itself, and a two-value option would swallow the next
    # flag when only one label is given).
    compare: list[str] | None = typer.Option(None, "--compare", help="A group label as printed in the table; "
                                              "give it twice: --compare advantage=rloo --compare advantage=grpo "
                                              "gives A - B with its 95% CI (Welch)."),
) -> None:
    """Curves (each seed + mean ± 95% CI), final/best validation reward per group, PNGs and one HTML page."""
    try:
        from fleetrl.report import build_report
    except ImportError as e:
        _fail(ImportError(f"`fleetrl report` needs matplotlib and scipy ({e}); pip install 'fleetrl[report]'"))
    target = out or (dirs[0] / "report" if len(dirs) == 1 else Path("report"))
    try:
        pair = _compare_pair(compare, dirs)
        result = build_report(list(dirs), target, compare=pair)
    except (UserError, ValueError, FileNotFoundError) as e:
        _fail(e)
    for w in result.warnings:
        console.print(Text.assemble(("warning: ", "yellow"), w), soft_wrap=True, highlight=False)  # w literally
    console.print(result.text_summary, highlight=False, soft_wrap=True)
    console.print(f"wrote {result.html} and {len(result.pngs)} PNG(s) in {target}")


def _compare_pair(compare: list[str] | None, dirs: list[Path]) -> tuple[str, str] | None:
    """The two --compare labels; the old `--compare A B` form leaves B among the DIRs, which is named."""
    if not compare:
        return None
    stray = [str(d) for d in dirs if not d.exists() and "=" in d.name]
    if len(compare) != 2:
        hint = f" ({', '.join(stray)} looks like a label given without its own --compare)" if stray else ""
        raise ValueError(f"--compare was given {len(compare)} time(s){hint}; give exactly two group labels, one "
                         f"per flag: --compare advantage=rloo --compare advantage=grpo")
    return compare[0], compare[1]


def register(app: typer.Typer) -> None:
    app.command()(sweep)
    app.command()(report)
