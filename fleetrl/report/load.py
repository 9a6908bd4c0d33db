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


def find_runs(dirs: list[Path]) -> list[Run]:
    """Each DIR is a run (holds metrics.jsonl), or a sweep/folder whose subfolders (two levels) are runs."""
    found: list[Path] = []
    for d in dirs:
        d = Path(d)
        if not d.is_dir():
            raise FileNotFoundError(f"{d} is not a directory; pass run directories (with metrics.jsonl) or "
                                    f"sweep directories")
        hits = [d] if (d / "metrics.jsonl").is_file() else sorted(
            p.parent for pattern in ("*/metrics.jsonl", "*/*/metrics.jsonl") for p in d.glob(pattern))
        if not hits:
            raise FileNotFoundError(f"{d}: no metrics.jsonl in it or in its subfolders; is it a run or sweep dir?")
        found += [h for h in hits if h not in found]
        found += [p for p in _failed_before_training(d) if p not in found]
    runs = []
    for path in found:
        steps, events, torn = read_metrics(path / "metrics.jsonl") if (path / "metrics.jsonl").is_file() else ({}, [], 0)
        runs.append(Run(path=path, steps=steps, events=events, torn_lines=torn, config=_read_config(path)))
    _attach_sweep_state(runs)
    assign_groups(runs)
    return runs


def assign_groups(runs: list[Run]) -> list[str]:
    """Sets `run.group` from the config keys whose values differ between runs; returns those keys."""
    keys = sorted({k for r in runs for k in r.config})
    differing = [k for k in keys if not k.startswith(_NOT_A_SETTING)
                 and len({json.dumps(r.config.get(k), sort_keys=True, default=str) for r in runs}) > 1]
    short = len({k.rsplit(".", 1)[-1] for k in differing}) == len(differing)
    for r in runs:
        parts = [f"{k.rsplit('.', 1)[-1] if short else k}={_show(r.config.get(k))}" for k in differing]
        r.group = ",".join(parts) or "all runs"
    return differing


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


def _failed_before_training(sweep_dir: Path) -> list[Path]:
    """Runs of a sweep that failed before writing any metrics (bad input is refused before a run starts): they
    are reported as failed too."""
    manifest = sweep_dir / "sweep.json"
    if not manifest.is_file():
        return []
    return [sweep_dir / rec["name"] for rec in json.loads(manifest.read_text()).get("runs", [])
            if rec.get("state") == "failed" and not (sweep_dir / rec["name"] / "metrics.jsonl").is_file()]


def _attach_sweep_state(runs: list[Run]) -> None:
    """Runs of a sweep carry their state and last error from the sweep's manifest (failed runs are reported)."""
    for r in runs:
        manifest = r.path.parent / "sweep.json"
        if not manifest.is_file():
            continue
        for rec in json.loads(manifest.read_text()).get("runs", []):
            if rec.get("name") == r.name:
                r.sweep_state, r.sweep_error = rec.get("state"), rec.get("error")


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _show(v: Any) -> str:
    return json.dumps(v, default=str) if isinstance(v, (dict, list)) else str(v)


def _finite(v: Any) -> bool:
    return isinstance(v, float) and math.isfinite(v)
