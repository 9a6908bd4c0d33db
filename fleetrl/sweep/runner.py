"""The sweep loop: start queued runs while resources allow, watch each run's heartbeat, retry a dead or stalled
run from its last checkpoint, and stop everything on Ctrl-C/SIGTERM.

Each run is `python -m fleetrl.cli.main train CONFIG <overrides> <seed/grid> trainer.output_dir=RUN_DIR` in
its own session, with its own CUDA_VISIBLE_DEVICES / cores, Ray temp dir and namespace. The loop is single-
threaded: signal handlers only set a flag, and the loop acts on it within one poll interval.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from fleetrl.config.schema import RunConfig
from fleetrl.sweep.health import Heartbeat
from fleetrl.sweep.manifest import Manifest, RunRecord
from fleetrl.sweep.process import RunProcess, end_orphan, log_tail, stop_all
from fleetrl.sweep.resources import (
    Allocator,
    Slot,
    cpus_needed,
    detect_cpus,
    detect_gpus,
    gpu_uuids,
    gpus_needed,
    run_bounded,
)
from fleetrl.sweep.table import StatusView
from fleetrl.sweep.validate import run_config

METRICS = "metrics.jsonl"


@dataclass(frozen=True, kw_only=True)
class SweepOptions:
    gpus_per_run: int | None = None
    """None = what the run's placement needs (0 when its pools ask for no GPU)."""
    cpus_per_run: int | None = None
    """None = the placement's CPUs when running on CPU; on GPU runs are not pinned to cores unless set."""
    max_parallel: int | None = None
    """None = as many runs as the resources hold."""
    retries: int = 0
    stall_s: float = 1800.0
    grace_s: float = 10.0
    poll_s: float = 1.0
    live: bool | None = None
    """Rich live table (None = when stdout is a terminal)."""


@dataclass
class _Active:
    rec: RunRecord
    proc: RunProcess
    slot: Slot
    beat: Heartbeat


class Sweep:
    def __init__(self, sweep_dir: Path, manifest: Manifest, options: SweepOptions, console: Console, *,
                 prepared: tuple[list[RunConfig], Allocator | None] | None = None) -> None:
        """`prepared`: the runs' configs (manifest order) and allocator that `start_sweep` has just checked;
        without it (a resumed sweep) both are derived here, which also re-validates every run's config."""
        self.dir, self.m, self.opt, self.console = Path(sweep_dir), manifest, options, console
        self.stop_signal: int | None = None
        self.hurry = False  # a second Ctrl-C: SIGKILL without waiting out the grace
        cfgs, alloc = prepared if prepared is not None else ([self._config(r) for r in manifest.runs], None)
        self.totals = {r.name: c.trainer.total_steps for r, c in zip(manifest.runs, cfgs, strict=True)}
        self.alloc = alloc if alloc is not None else make_allocator(cfgs, options)
        self.m.options = {**self.m.options, "resources": {"gpus_per_run": self.alloc.gpus_per_run,
                                                          "cpus_per_run": self.alloc.cpus_per_run,
                                                          "max_parallel": self.alloc.max_parallel},
                          "retries": options.retries, "stall_s": options.stall_s}
        # Every run's latest heartbeat, kept after the run ends: the table shows a finished run's last step and
        # reward, not a blank row. A run finished by an earlier invocation of this sweep is read once here.
        self.beats = {r.name: _read_once(self.dir / r.name / METRICS, self.totals[r.name])
                      for r in manifest.runs if r.state == "finished"}

    # ------------------------------------------------------------------------------------------- the loop
    def run(self) -> int:
        """Runs every unfinished run; returns 0 when all finished, 1 when some failed, 130 when stopped."""
        queue = [r for r in self.m.runs if r.state != "finished"]
        for r in queue:
            if r.state == "running" and r.pid and r.pid_created and end_orphan(r.pid, r.pid_created, self.opt.grace_s):
                self._say(f"[yellow]ended[/] {r.name} (pid {r.pid}), left running by a sweep that was killed")
            r.state = "queued"
        self.m.save(self.dir)
        active: list[_Active] = []
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        view = StatusView(self.console, self.opt.live)
        try:
            with view:
                while (queue or active) and self.stop_signal is None:
                    while queue and (slot := self.alloc.acquire()) is not None:
                        active.append(self._launch(queue.pop(0), slot))
                    for a in list(active):
                        if self._check(a, queue):
                            active.remove(a)
                            self.alloc.release(a.slot)
                    view.update(self.m.runs, self.beats, self.totals)
                    self._sleep(self.opt.poll_s)
                if self.stop_signal is not None:
                    self._stop(active, queue)
        except BaseException:
            # A bug or an OS error in the loop must not leave runs behind: they are in their own sessions.
            stop_all([a.proc for a in active], grace_s=self.opt.grace_s)
            raise
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        self._summary()
        if self.stop_signal is not None:
            return 130
        return 1 if any(r.state == "failed" for r in self.m.runs) else 0

    def _on_signal(self, signum: int, _frame) -> None:
        self.hurry = self.stop_signal is not None
        self.stop_signal = signum

    def _sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end and self.stop_signal is None:
            time.sleep(0.05)

    # ------------------------------------------------------------------------------------------- one run
    def _launch(self, rec: RunRecord, slot: Slot) -> _Active:
        run_dir = self.dir / rec.name
        run_dir.mkdir(parents=True, exist_ok=True)
        metrics = run_dir / METRICS
        # Always `auto`: a fresh run dir has no checkpoint, so it starts from scratch; a retry or a resumed sweep
        # continues from the newest complete checkpoint, and the config stays the same across attempts.
        resume = "auto"
        if metrics.exists() and metrics.stat().st_size:
            # Marks where this attempt's (repeated) steps begin, for readers of metrics.jsonl (`fleetrl report`).
            last = _read_once(metrics, None)
            with open(metrics, "a") as f:
                f.write(json.dumps({"step": last.step, "event": "restart", "source": "sweep",
                                    "attempt": rec.attempts + 1}) + "\n")
        rec.attempts += 1
        rec.state, rec.resources, rec.exit_code = "running", slot.describe(), None
        rec.started, rec.ended = time.time(), None
        rec.ray_tmp = _ray_tmp(self.dir, rec.name)
        cmd = [*slot.command_prefix(), sys.executable, "-m", "fleetrl.cli.main", "train", self.m.config,
               *self._run_overrides(rec, slot), f"trainer.output_dir={run_dir}", f"trainer.resume={resume}"]
        env = {**os.environ, **slot.env(), "PYTHONUNBUFFERED": "1", "FLEETRL_RAY_TMPDIR": rec.ray_tmp,
               "FLEETRL_RAY_NAMESPACE": f"sweep-{rec.name}"[:60]}
        if slot.gpus:
            _record_devices(run_dir, slot, env)
        proc = RunProcess.start(cmd, env, run_dir / "train.log")
        rec.pid, rec.pid_created = proc.pid, _created(proc.pid)
        self.m.save(self.dir)
        self._say(f"[cyan]start[/] {rec.name} (attempt {rec.attempts}, {rec.resources})")
        self.beats[rec.name] = Heartbeat(metrics, self.totals[rec.name])
        return _Active(rec, proc, slot, self.beats[rec.name])

    def _check(self, a: _Active, queue: list[RunRecord]) -> bool:
        """Polls one run; True when it ended (finished, failed, or queued again for a retry)."""
        a.proc.snapshot()
        # Exit code first, then the file: once the process is seen to have exited, this poll reads its last
        # lines (the other order misses what it wrote between the two calls, e.g. the final step).
        code = a.proc.poll()
        a.beat.poll()
        if code is None and a.beat.silent_for() < self.opt.stall_s:
            return False
        if code is None:
            reason = f"stalled: no new line in metrics.jsonl for {a.beat.silent_for():.0f} s (--stall-s)"
        else:
            reason = f"exited with code {code}"
        # A stalled run is ended like on Ctrl-C; an exited one may have left its Ray behind after a crash.
        stop_all([a.proc], self.opt.grace_s if code is None else 2.0)
        a.rec.exit_code, a.rec.ended = code, time.time()
        if code == 0:
            a.rec.state, a.rec.error = "finished", None
            shutil.rmtree(a.rec.ray_tmp or "", ignore_errors=True)
            self._say(f"[green]done[/] {a.rec.name}")
        else:
            self._fail(a, reason, queue)
        self.m.save(self.dir)
        return True

    def _fail(self, a: _Active, reason: str, queue: list[RunRecord]) -> None:
        tail = log_tail(a.proc.log_path)
        a.rec.error = f"{reason}\n{tail}"
        a.rec.failures += 1
        retry = a.rec.failures <= self.opt.retries
        a.rec.state = "queued" if retry else "failed"
        what = f"retrying from its last checkpoint ({a.rec.failures}/{self.opt.retries})" if retry else "giving up"
        self._say(f"[bold red]{a.rec.name}[/] {reason}; {what}. Log: {a.proc.log_path}\n[dim]{_escape(tail)}[/]")
        if retry:
            queue.insert(0, a.rec)

    def _stop(self, active: list[_Active], queue: list[RunRecord]) -> None:
        name = signal.Signals(self.stop_signal).name
        self._say(f"[yellow]{name}[/]: stopping {len(active)} run(s) (SIGTERM, SIGKILL after {self.opt.grace_s:.0f} s)")
        left = stop_all([a.proc for a in active], self.opt.grace_s, hurry=lambda: self.hurry)
        for a in active:
            a.rec.state, a.rec.ended = "stopped", time.time()
            self.alloc.release(a.slot)
            shutil.rmtree(a.rec.ray_tmp or "", ignore_errors=True)  # a killed Ray's session: nothing to keep
        for r in queue:
            r.state = "stopped"
        self.m.save(self.dir)
        if left:
            self._say(f"[bold red]processes still alive after SIGKILL: {left}[/] (stuck in the kernel?)")
        self._say(f"continue with: fleetrl sweep --resume {self.dir}")

    # ------------------------------------------------------------------------------------------- helpers
    def _run_overrides(self, rec: RunRecord, slot: Slot) -> list[str]:
        extra = ["tracking.progress=false"]  # a progress bar in a log file is noise
        if slot.cpus:
            extra.append(f"cluster.num_cpus={len(slot.cpus)}")
        return [*self.m.overrides, *rec.spec.overrides(), *extra]

    def _config(self, rec: RunRecord) -> RunConfig:
        return run_config(self.m.config, [*self.m.overrides, *rec.spec.overrides()])

    def _say(self, text: str) -> None:
        self.console.print(text, highlight=False, soft_wrap=True)

    def _summary(self) -> None:
        counts = ", ".join(f"{n} {s}" for s, n in self.m.counts().items())
        self._say(f"[bold]sweep[/] {self.dir}: {counts}")
        for r in self.m.runs:
            if r.state == "failed":
                self._say(f"[red]failed[/] {r.name}: {_escape((r.error or '').splitlines()[0])} "
                          f"(log: {self.dir / r.name / 'train.log'})")


def make_allocator(cfgs: list[RunConfig], opt: SweepOptions) -> Allocator:
    """One slot size for all runs: the largest any run's placement needs (a grid may change placement).
    ValueError when one run needs more than this machine has."""
    gpus = detect_gpus()
    need_g = max(gpus_needed(c) for c in cfgs) if gpus else 0
    g = opt.gpus_per_run if opt.gpus_per_run is not None else need_g
    c = opt.cpus_per_run if opt.cpus_per_run is not None else (0 if g else max(cpus_needed(c) for c in cfgs))
    cpus = detect_cpus()
    per_run = [n // k for n, k in ((len(gpus), g), (len(cpus), c)) if k]
    max_parallel = opt.max_parallel or (min(per_run) if per_run else 1)
    return Allocator(gpus, cpus, g, c, max(1, max_parallel))


def _read_once(metrics: Path, total_steps: int | None) -> Heartbeat:
    beat = Heartbeat(metrics, total_steps)
    beat.poll()
    return beat


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def _created(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def _ray_tmp(sweep_dir: Path, name: str) -> str:
    """Short on purpose: Ray's Unix sockets live under it and their paths may not exceed 107 bytes."""
    h = hashlib.sha1(f"{sweep_dir.resolve()}/{name}".encode()).hexdigest()[:10]
    return str(Path(tempfile.gettempdir()) / f"frl-{h}")


def _record_devices(run_dir: Path, slot: Slot, env: dict[str, str]) -> None:
    """device.json: the GPUs this run was given, by nvidia-smi index/UUID and as torch.cuda sees them from the
    run's environment (the proof that two runs' devices are disjoint)."""
    smi = gpu_uuids()
    info: dict = {"cuda_visible_devices": env["CUDA_VISIBLE_DEVICES"],
                  "nvidia_smi_uuids": [smi[int(g)] for g in slot.gpus if g.isdigit() and int(g) < len(smi)]}
    probe = ("import json, torch; print(json.dumps([str(torch.cuda.get_device_properties(i).uuid) "
             "for i in range(torch.cuda.device_count())]))")
    try:
        out = run_bounded([sys.executable, "-c", probe], env=env, timeout_s=120)
        info["torch_uuids"] = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else out.stderr[-500:]
    except (subprocess.SubprocessError, ValueError, IndexError) as e:
        info["torch_uuids"] = f"probe failed: {e}"
    (run_dir / "device.json").write_text(json.dumps(info, indent=2))
