"""One run as an operating-system process tree, and how to end every process in it.

Each run starts in its own session (`start_new_session=True`), so its process group id is its pid and a
terminal's Ctrl-C reaches only the sweep, which then decides how runs end. A run's tree also holds its local
Ray (GCS, raylet, workers); some of those may leave the group or be re-parented to init once the driver dies,
so the tree's members are remembered while it is alive (`snapshot`) and every remembered process is ended too.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psutil


class RunProcess:
    def __init__(self, popen: subprocess.Popen, log_path: Path) -> None:
        self.popen = popen
        self.log_path = log_path
        self.pid = popen.pid
        self.started = time.monotonic()
        # pid -> create_time: a pid reused by an unrelated process after ours exited must never be signalled.
        self.known: dict[int, float] = {}
        self.snapshot()

    @classmethod
    def start(cls, cmd: list[str], env: dict[str, str], log_path: Path, cwd: Path | None = None) -> RunProcess:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            log.write(f"\n$ {' '.join(cmd)}\n".encode())
            log.flush()
            popen = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     cwd=cwd, start_new_session=True)
        return cls(popen, log_path)

    def poll(self) -> int | None:
        return self.popen.poll()

    def snapshot(self) -> None:
        """Remember every current member of the run's tree and session."""
        try:
            procs = psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:
            procs = []
        procs += session_members(self.pid)
        for p in procs:
            try:
                self.known.setdefault(p.pid, p.create_time())
            except psutil.Error:
                pass

    def alive_members(self) -> list[psutil.Process]:
        """Processes of this run still running: the leader, remembered descendants, its session."""
        out: dict[int, psutil.Process] = {}
        for pid, created in [(self.pid, None), *self.known.items()]:
            try:
                p = psutil.Process(pid)
                if (created is None or abs(p.create_time() - created) < 1e-3) and p.status() != psutil.STATUS_ZOMBIE:
                    out[pid] = p
            except psutil.Error:
                pass
        for p in session_members(self.pid):
            out.setdefault(p.pid, p)
        return list(out.values())

    def signal_all(self, sig: int) -> None:
        self.snapshot()
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        for p in self.alive_members():
            try:
                p.send_signal(sig)
            except psutil.Error:
                pass

    def reap(self) -> None:
        """Collect the leader's exit status so it does not linger as a zombie."""
        if self.popen is None:  # not our child (an orphan of an earlier sweep): init reaps it
            return
        try:
            self.popen.wait(timeout=0.1)
        except subprocess.TimeoutExpired:
            pass


def session_members(sid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if p.pid != sid and os.getsid(p.pid) == sid:
                out.append(p)
        except (psutil.Error, ProcessLookupError, PermissionError):
            pass
    return out


def stop_all(runs: list[RunProcess], grace_s: float, deadline_s: float = 30.0,
             hurry: Callable[[], bool] = lambda: False) -> list[int]:
    """SIGTERM every run's processes, wait up to `grace_s` (cut short when `hurry()` turns true, e.g. a second
    Ctrl-C), then SIGKILL what is left; returns the pids still alive after `deadline_s` (empty unless a process
    is stuck in the kernel)."""
    start = time.monotonic()
    for r in runs:
        r.signal_all(signal.SIGTERM)
    while time.monotonic() - start < grace_s and not hurry() and any(r.alive_members() for r in runs):
        for r in runs:
            r.reap()
        time.sleep(0.2)
    left: list[psutil.Process] = []
    while time.monotonic() - start < deadline_s:
        for r in runs:
            r.signal_all(signal.SIGKILL)
            r.reap()
        left = [p for r in runs for p in r.alive_members()]
        if not left:
            break
        time.sleep(0.2)
    return [p.pid for p in left]


def log_tail(path: Path, lines: int = 25, max_bytes: int = 64_000) -> str:
    """The last `lines` lines of a log (read from the end: logs of long runs are large)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            text = f.read().decode(errors="replace")
    except OSError as e:
        return f"(no log: {e})"
    return "\n".join(text.splitlines()[-lines:])


def end_orphan(pid: int, created: float, grace_s: float) -> bool:
    """Ends the session of a run left behind by a sweep that died without stopping it; True when there was one.
    The pid counts only if it is still the process that was started (same create_time) and leads its session."""
    try:
        p = psutil.Process(pid)
        if abs(p.create_time() - created) > 1e-3 or os.getsid(pid) != pid:
            return False
    except (psutil.Error, ProcessLookupError):
        return False
    run = RunProcess.__new__(RunProcess)
    run.pid, run.known, run.popen = pid, {}, None
    stop_all([run], grace_s)
    return True
