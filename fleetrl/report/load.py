"""Reading runs for a report: find run directories, read metrics.jsonl without double counting, and group runs
by the config values that differ between them (seeds are replicates, not groups).

Double counting: a run that was restarted (by its supervisor, or by `fleetrl sweep` after a crash) resumes
from a checkpoint and writes the steps after it again. metrics.jsonl is read as *segments*, a new one starting
at a `restart`/`resumed` event or wherever the step goes backwards; each step keeps the records of the LAST
segment that wrote it (records of one step within one segment are merged). A record with `superseded: true`
is dropped.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fleetrl.sweep.manifest import MANIFEST, Manifest, ManifestError, RunRecord
from fleetrl.trainer.metric_names import is_machine_metric

_SEGMENT_EVENTS = ("restart", "resumed")
# Config keys that differ between runs without making them different settings.
_NOT_A_SETTING = ("trainer.seed", "trainer.output_dir", "trainer.resume", "trainer.name", "cluster.num_cpus",
                  "tracking.")


@dataclass
class Run:
    path: Path
    steps: dict[int, dict[str, float]]
    """step -> metric -> value, after dropping superseded records."""
    events: list[dict[str, Any]] = field(default_factory=list)
    torn_lines: int = 0
    config: dict[str, Any] = field(default_factory=dict)
    """Flattened config.yaml (`trainer.seed` -> 42)."""
    group: str = ""
    """Label of the run's setting; "" = left out of the groups (no config.yaml to read the setting from)."""
    has_config: bool = True
    sweep_state: str | None = None
    sweep_error: str | None = None

    @property
    def seed(self) -> Any:
        return self.config.get("trainer.seed", "?")

    @property
    def name(self) -> str:
        return self.path.name

    def series(self, key: str) -> tuple[list[int], list[float]]:
        pts = [(s, r[key]) for s, r in sorted(self.steps.items()) if _finite(r.get(key))]
        return [s for s, _ in pts], [v for _, v in pts]

    def metric_keys(self) -> set[str]:
        return {k for r in self.steps.values() for k in r}


def read_metrics(path: Path) -> tuple[dict[int, dict[str, float]], list[dict], int]:
    """(step -> merged record of its last segment, events, number of unreadable lines)."""
    latest: dict[int, tuple[int, dict[str, float]]] = {}  # step -> (segment, merged record)
    events: list[dict] = []
    torn, segment, prev_step = 0, 0, -1
    for line in Path(path).read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            torn += 1  # the last line of a killed attempt
            continue
        if not isinstance(rec, dict) or rec.get("superseded") is True:
            continue
        if "event" in rec:
            events.append(rec)
            if rec["event"] in _SEGMENT_EVENTS:
                segment += 1
            continue
        step = rec.get("step")
        if not isinstance(step, int):
            continue
        if step < prev_step:
            segment += 1
        prev_step = step
        values = {k: float(v) for k, v in rec.items() if k != "step" and isinstance(v, (int, float))}
        seg, old = latest.get(step, (segment, {}))
        latest[step] = (segment, {**old, **values} if seg == segment else values)
    return {s: r for s, (_, r) in sorted(latest.items())}, events, torn


def find_runs(dirs: list[Path], warnings: list[str] | None = None) -> list[Run]:
    """Each DIR is a run (holds metrics.jsonl), or a sweep/folder whose subfolders (two levels) are runs.
    Problems that still leave a report to make (a damaged sweep.json) are appended to `warnings`."""
    warnings = [] if warnings is None else warnings
    manifests: dict[Path, dict[str, RunRecord]] = {}
    found: list[Path] = []
    for d in dirs:
        d = Path(d)
        if not d.is_dir():
            raise FileNotFoundError(f"{d} is not a directory; pass run directories (with metrics.jsonl) or "
                                    f"sweep directories")
        hits = [d] if (d / "metrics.jsonl").is_file() else sorted(
            p.parent for pattern in ("*/metrics.jsonl", "*/*/metrics.jsonl") for p in d.glob(pattern))
        failed = _failed_before_training(d, _records(d, manifests, warnings))
        if not hits and not failed:
            raise FileNotFoundError(f"{d}: no metrics.jsonl in it or in its subfolders; is it a run or sweep dir?")
        found += [p for p in [*hits, *failed] if p not in found]
    runs = [_load_run(path) for path in found]
    for r in runs:  # runs of a sweep carry their state and last error from its manifest (failed runs are reported)
        rec = _records(r.path.parent, manifests, warnings).get(r.name)
        if rec is not None:
            r.sweep_state, r.sweep_error = rec.state, rec.error
            if not r.has_config:  # its seed is known from the manifest even so
                r.config = {"trainer.seed": rec.seed}
    assign_groups(runs)
    return runs


def _load_run(path: Path) -> Run:
    metrics = path / "metrics.jsonl"
    steps, events, torn = read_metrics(metrics) if metrics.is_file() else ({}, [], 0)
    return Run(path=path, steps=steps, events=events, torn_lines=torn, config=_read_config(path),
               has_config=(path / "config.yaml").is_file())


def assign_groups(runs: list[Run]) -> list[str]:
    """Sets `run.group` from the config keys whose values differ between runs; returns those keys. A run without
    config.yaml (it failed before writing one) has no setting to compare: it gets no group (see run_warnings)."""
    known = [r for r in runs if r.has_config]
    keys = sorted({k for r in known for k in r.config})
    differing = [k for k in keys if not k.startswith(_NOT_A_SETTING)
                 and len({json.dumps(r.config.get(k), sort_keys=True, default=str) for r in known}) > 1]
    short = len({k.rsplit(".", 1)[-1] for k in differing}) == len(differing)
    for r in runs:
        parts = [f"{k.rsplit('.', 1)[-1] if short else k}={_show(r.config.get(k))}" for k in differing]
        r.group = (",".join(parts) or "all runs") if r.has_config else ""
    return differing


def run_warnings(runs: list[Run]) -> list[str]:
    """What a reader must know about runs that add nothing (or less than it seems) to the curves and table."""
    out = []
    for r in runs:
        if not r.has_config:
            why = f"sweep state {r.sweep_state}" + (f": {_first_line(r.sweep_error)}" if r.sweep_error else "") \
                if r.sweep_state else "the run did not start"
            out.append(f"{r.path}: no config.yaml ({why}); left out of the groups, curves and score table")
        elif (r.path / "metrics.jsonl").is_file() and not r.steps:
            out.append(f"{r.path}/metrics.jsonl holds no step record (the run logged nothing yet); the run has "
                       f"no curve and no score")
        if r.torn_lines:
            out.append(f"{r.path}/metrics.jsonl: {r.torn_lines} unreadable line(s) skipped (a killed attempt's "
                       f"last line)")
    return out


def same_metrics(a: Run, b: Run) -> str | None:
    """None when a and b logged the same learning metrics at every common step, else where they first differ."""
    for step in sorted(set(a.steps) & set(b.steps)):
        ra, rb = a.steps[step], b.steps[step]
        for k in sorted(set(ra) | set(rb)):
            if is_machine_metric(k):  # timings and memory peaks: the machine, not the learning
                continue
            va, vb = ra.get(k), rb.get(k)
            if va != vb and not (va is not None and vb is not None and math.isnan(va) and math.isnan(vb)):
                return f"step {step} {k}: {va} vs {vb}"
    if set(a.steps) != set(b.steps):
        return f"logged steps differ ({len(a.steps)} vs {len(b.steps)})"
    return None


def _read_config(path: Path) -> dict[str, Any]:
    cfg = path / "config.yaml"
    if not cfg.is_file():
        return {}
    return _flatten(yaml.safe_load(cfg.read_text()) or {})


def _records(sweep_dir: Path, cache: dict[Path, dict[str, RunRecord]], warnings: list[str]) -> dict[str, RunRecord]:
    """The runs of the sweep manifest in `sweep_dir` by name ({} when there is none, or it is damaged: the run
    directories alone still make a report, so that is a warning)."""
    if sweep_dir not in cache:
        cache[sweep_dir] = {}
        if (sweep_dir / MANIFEST).is_file():
            try:
                cache[sweep_dir] = {r.name: r for r in Manifest.load(sweep_dir).runs}
            except ManifestError as e:
                warnings.append(f"{e} (the report shows the run directories without sweep states)")
    return cache[sweep_dir]


def _failed_before_training(sweep_dir: Path, records: dict[str, RunRecord]) -> list[Path]:
    """Runs of a sweep that failed before writing any metrics (bad input is refused before a run starts): they
    are reported as failed too."""
    return [sweep_dir / name for name, rec in records.items()
            if rec.state == "failed" and not (sweep_dir / name / "metrics.jsonl").is_file()]


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _first_line(text: str) -> str:
    return (text.strip().splitlines() or [""])[0]


def _show(v: Any) -> str:
    return json.dumps(v, default=str) if isinstance(v, (dict, list)) else str(v)


def _finite(v: Any) -> bool:
    return isinstance(v, float) and math.isfinite(v)
