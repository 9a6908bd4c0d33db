"""Runs untrusted Python (a model's tool call, a code answer) in a separate, limited process.

Layers, each independent of the others (docs/envs.md lists what each one guarantees and where it stops):
  wall time     the whole process group is SIGKILLed at `wall_s`; with a PID namespace, the namespace dies too.
  CPU time      RLIMIT_CPU: SIGXCPU at `cpu_s`, SIGKILL a second later (kernel-enforced).
  memory        RLIMIT_AS on the worker (kernel-enforced; Python raises MemoryError).
  processes     a pids cgroup with pids.max = `max_procs` when /sys/fs/cgroup is writable (kernel-enforced, also
                for root), else RLIMIT_NPROC (enforced only for a non-root uid), else (root without cgroups) the
                audit hook refuses fork; plus `unshare --pid`: when the run ends, every process it started dies
                with its PID namespace.
  network       `unshare --net`: an empty network namespace, no interfaces but a down loopback (kernel-enforced);
                and an audit hook refusing socket connect/bind/sendto (in-process, Python-level only).
  files         the worker runs in a fresh temp dir; an audit hook refuses opening for write, renaming,
                deleting... outside it (Python-level only); RLIMIT_FSIZE caps every file it writes, its captured
                stdout/stderr included, so output cannot fill the disk.
Output is cut to `max_output_bytes` per stream: the head of stdout, the tail of stderr.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass

_BOOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_boot.py")
_CGROUP_ROOTS = ("/sys/fs/cgroup/pids", "/sys/fs/cgroup")  # cgroup v1 pids controller, then the v2 hierarchy

# Why a run failed; None when it exited 0.
REASON_WALL = "wall_time"
REASON_CPU = "cpu_time"
REASON_MEMORY = "memory"
REASON_PROCS = "process_limit"
REASON_DENIED = "denied"  # the audit hook refused an operation (network, write outside the sandbox dir, exec)
REASON_ERROR = "error"    # any other non-zero exit (an exception in the code)


@dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    """Per-run limits. Times in seconds (`cpu_s` is rounded down to whole seconds, at least 1)."""

    cpu_s: float = 5.0
    wall_s: float = 10.0
    memory_mb: int = 512
    max_procs: int = 16
    max_output_bytes: int = 8192
    max_file_bytes: int = 1 << 20
    isolate_network: bool = True  # use `unshare --net --pid` when available

    def __post_init__(self) -> None:
        if self.cpu_s < 1 or self.wall_s <= 0 or self.memory_mb < 32 or self.max_procs < 2:
            raise ValueError(f"SandboxLimits: need cpu_s >= 1, wall_s > 0, memory_mb >= 32 (the interpreter "
                             f"itself needs ~20 MB) and max_procs >= 2 (supervisor + worker); got {self}")


@dataclass(frozen=True)
class SandboxResult:
    """stdout/stderr are decoded (errors replaced) and cut to the limit; `truncated` says whether either was."""

    stdout: str
    stderr: str
    exit_code: int | None  # negative: killed by that signal; None: killed at the wall-time limit
    reason: str | None     # one of the REASON_* constants, None on success
    wall_s: float
    cpu_s: float
    truncated: bool
    layers: tuple[str, ...]  # the isolation layers that were active, e.g. ("netns", "pidns", "cgroup")

    @property
    def ok(self) -> bool:
        return self.reason is None


def run_python(code: str, limits: SandboxLimits = SandboxLimits(), *, stdin: str = "") -> SandboxResult:
    """Runs `code` as a script in a fresh sandbox and returns what happened; never raises for the code's faults."""
    private = tempfile.mkdtemp(prefix="fleetrl-sbx-")
    workdir = os.path.join(private, "work")
    os.mkdir(workdir)
    cgroup = _make_cgroup(limits.max_procs)
    layers = []
    try:
        spec = {"workdir": workdir, "code_path": os.path.join(private, "code.py"),
                "status_path": os.path.join(private, "status.json"),
                "cgroup_procs": os.path.join(cgroup, "cgroup.procs") if cgroup else "",
                "cpu_s": max(1, int(limits.cpu_s)), "memory_mb": limits.memory_mb, "max_procs": limits.max_procs,
                "max_file_bytes": max(limits.max_file_bytes, limits.max_output_bytes),
                # Root ignores RLIMIT_NPROC: without a pids cgroup nothing in the kernel caps the process count,
                # so the audit hook refuses fork altogether rather than trusting the wall-time kill alone.
                "deny_fork": cgroup is None and os.getuid() == 0,
                "set_nproc": cgroup is None and os.getuid() != 0}
        with open(spec["code_path"], "w") as f:
            f.write(code)
        command = [sys.executable, "-I", _BOOT, json.dumps(spec)]
        if limits.isolate_network and _unshare_works():
            command = [*_unshare_args(), *command]
            layers += ["netns", "pidns"]
        layers += ["cgroup"] if cgroup else ["rlimit_nproc"] if os.getuid() != 0 else ["no_fork"]
        return _run(command, spec, private, stdin, limits, cgroup, tuple(layers))
    finally:
        if cgroup:
            _remove_cgroup(cgroup)
        shutil.rmtree(private, ignore_errors=True)


def _run(command: list[str], spec: dict, private: str, stdin: str, limits: SandboxLimits, cgroup: str | None,
         layers: tuple[str, ...]) -> SandboxResult:
    out_path, err_path, in_path = (os.path.join(private, n) for n in ("stdout", "stderr", "stdin"))
    with open(in_path, "w") as f:
        f.write(stdin)
    start = time.monotonic()
    with open(out_path, "wb") as out, open(err_path, "wb") as err, open(in_path, "rb") as inp:
        proc = subprocess.Popen(command, stdin=inp, stdout=out, stderr=err, start_new_session=True,
                                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"})
        try:
            proc.wait(timeout=limits.wall_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _kill_group(proc)
    wall = time.monotonic() - start
    status = _read_json(spec["status_path"])
    stdout, cut_out = _read_capped(out_path, limits.max_output_bytes)
    stderr, cut_err = _read_capped(err_path, limits.max_output_bytes, tail=True)  # a traceback ends usefully
    exc = _read_json(spec["status_path"] + ".exc") or {}
    hit_pids = bool(cgroup) and _pids_limit_hit(cgroup)
    exit_code = None if timed_out or status is None else status["exit_code"]
    cpu = status["cpu_s"] if status else 0.0
    reason = _reason(timed_out, exit_code, cpu, exc, hit_pids, spec["cpu_s"])
    return SandboxResult(stdout=stdout, stderr=stderr, exit_code=exit_code, reason=reason, wall_s=wall, cpu_s=cpu,
                         truncated=cut_out or cut_err, layers=layers)


def _reason(timed_out: bool, exit_code: int | None, cpu: float, exc: dict, hit_pids: bool,
            cpu_limit: int) -> str | None:
    """`exc`: {"type", "message"} of the worker's fatal exception, {} if it had none."""
    if exit_code == 0 and not timed_out:
        return None
    if timed_out:
        return REASON_WALL
    # SIGXCPU comes only from RLIMIT_CPU; a SIGKILL is the rlimit's hard stop when the CPU time reached the limit
    # (rusage is tick-granular, hence the 10% slack).
    if exit_code == -signal.SIGXCPU or (exit_code == -signal.SIGKILL and cpu >= 0.9 * cpu_limit):
        return REASON_CPU
    kind = exc.get("type")
    if kind == "MemoryError":
        return REASON_MEMORY
    if hit_pids or kind == "BlockingIOError":
        return REASON_PROCS
    if kind == "PermissionError" and str(exc.get("message", "")).startswith("sandbox:"):
        return REASON_DENIED
    return REASON_ERROR


def _kill_group(proc: subprocess.Popen) -> None:
    # The PID namespace takes every descendant with it once unshare (and with it PID 1) is gone.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:  # SIGKILL ends it at once; one stuck in the kernel (D state) is left to the OS rather than waited on
        proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        pass


def _read_capped(path: str, cap: int, tail: bool = False) -> tuple[str, bool]:
    """The first (or last) `cap` bytes of a file, and whether it held more."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - cap) if tail else 0)
        data = f.read(cap)
    return data.decode("utf-8", errors="replace"), size > cap


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


_UNSHARE: list[list[str]] = []  # cached: [] = not probed yet, [[]] = unavailable, [args] = works


def _unshare_args() -> list[str]:
    """The `unshare` prefix that works here: plain namespaces as root, or inside a new user namespace
    (`--user --map-root-user`) where unprivileged user namespaces are allowed; [] when neither does."""
    if not _UNSHARE:
        found: list[str] = []
        if shutil.which("unshare"):
            for extra in ([], ["--user", "--map-root-user"]):
                args = ["unshare", *extra, "--net", "--pid", "--fork", "--kill-child", "--"]
                try:
                    if subprocess.run([*args, "true"], check=False, capture_output=True, timeout=10).returncode == 0:
                        found = args
                        break
                except (OSError, subprocess.TimeoutExpired):
                    pass
        _UNSHARE.append(found)
    return _UNSHARE[0]


def _unshare_works() -> bool:
    return bool(_unshare_args())


def _make_cgroup(max_procs: int) -> str | None:
    """A fresh pids cgroup with pids.max set, or None where cgroups are not writable (then see RLIMIT_NPROC)."""
    for root in _CGROUP_ROOTS:
        if not os.path.exists(os.path.join(root, "cgroup.procs")):
            continue
        path = os.path.join(root, f"fleetrl-sbx-{uuid.uuid4().hex[:12]}")
        try:
            os.mkdir(path)
        except OSError:
            continue
        try:
            with open(os.path.join(path, "pids.max"), "w") as f:
                f.write(str(max_procs))
            return path
        except OSError:
            os.rmdir(path)
    return None


def _pids_limit_hit(cgroup: str) -> bool:
    try:
        with open(os.path.join(cgroup, "pids.events")) as f:
            return any(line.split()[0] == "max" and int(line.split()[1]) > 0 for line in f if line.strip())
    except (OSError, ValueError, IndexError):
        return False


def _remove_cgroup(cgroup: str) -> None:
    """Kills anything still in the cgroup (nothing, normally: the PID namespace is gone), then removes it."""
    for _ in range(50):
        try:
            with open(os.path.join(cgroup, "cgroup.procs")) as f:
                pids = [int(p) for p in f.read().split()]
        except OSError:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.rmdir(cgroup)
            return
        except OSError:
            time.sleep(0.02)  # the killed processes are still being reaped
