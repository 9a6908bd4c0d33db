"""Two "hosts" on one machine: network namespaces joined by a veth pair, for multi-node tests.

    with netns_pair() as (a, b):          # a.ip = 10.213.N.1, b.ip = 10.213.N.2
        proc = a.popen(["python", "-m", "http.server", "8000", "--bind", a.ip])
        b.run(["curl", f"http://{a.ip}:8000"])

Each namespace has its own loopback and one veth end; nothing else is routed, so the hosts only reach each
other (and only addresses this helper created are ever used). The filesystem stays shared, as on a cluster
with a shared home; `mount_private` runs a command in its own mount namespace (`unshare -m`) with a tmpfs
over one path, which is how a test gets a directory that one "host" does not share.

Cleanup always runs: processes started through a Host are killed by PID (their whole session, since each
is started as a session leader), then any process still inside a namespace (`ip netns pids`), then the
namespaces themselves, which takes the veth pair with them.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

SUBNET_PREFIX = "10.213"  # private range; the third octet is derived from the PID so parallel runs differ


def skip_reason() -> str | None:
    """Why namespace tests cannot run here, or None when they can."""
    if os.name != "posix" or os.geteuid() != 0:
        return "network-namespace tests need root (ip netns add)"
    if shutil.which("ip") is None:
        return "`ip` not found: install iproute2 (apt-get install -y iproute2)"
    probe = f"frlprobe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed here ({made.stderr.strip()}); the container lacks CAP_SYS_ADMIN"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode:
        return "`unshare -m` failed here (util-linux missing or no CAP_SYS_ADMIN): no private mounts for a node"
    return None


@dataclass
class Host:
    """One namespace: its name, its address on the veth link, and the interface that carries it."""

    name: str
    ip: str
    iface: str
    _procs: list[subprocess.Popen] = field(default_factory=list, repr=False)

    def command(self, cmd: Sequence[str], *, private_tmpfs: str | None = None) -> list[str]:
        """`cmd` wrapped to run inside this namespace (and, if asked, a mount namespace with a private tmpfs)."""
        wrapped = ["ip", "netns", "exec", self.name]
        if private_tmpfs is None:
            return wrapped + list(cmd)
        script = 'mount -t tmpfs frl-private "$1" && shift && exec "$@"'
        return wrapped + ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh",
                          private_tmpfs, *cmd]

    def run(self, cmd: Sequence[str], *, timeout: float = 120, env: dict[str, str] | None = None,
            private_tmpfs: str | None = None) -> subprocess.CompletedProcess:
        """Runs to completion in this namespace; stdout/stderr captured as text. Killed on timeout."""
        proc = self.popen(cmd, env=env, private_tmpfs=private_tmpfs, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_session(proc.pid)
            out, err = proc.communicate()
            raise AssertionError(f"timed out after {timeout}s in {self.name}: {' '.join(cmd)}\n"
                                 f"stdout:\n{out}\nstderr:\n{err}") from None
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def popen(self, cmd: Sequence[str], *, env: dict[str, str] | None = None,
              private_tmpfs: str | None = None, **kwargs) -> subprocess.Popen:
        """Starts in this namespace as a session leader; the helper kills its session at cleanup."""
        proc = subprocess.Popen(self.command(cmd, private_tmpfs=private_tmpfs), env=env, text=True,
                                start_new_session=True, stdin=subprocess.DEVNULL, **kwargs)
        self._procs.append(proc)
        return proc

    def _cleanup(self) -> None:
        for proc in self._procs:
            _kill_session(proc.pid)
            with contextlib.suppress(Exception):
                proc.wait(timeout=10)
        listed = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True, text=True)
        for pid in (int(p) for p in listed.stdout.split()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def netns_pair(tag: str | None = None) -> Iterator[tuple[Host, Host]]:
    """Creates namespaces frl<tag>a / frl<tag>b joined by veth frl<tag>a0 <-> frl<tag>b0 on 10.213.N.0/24."""
    tag = tag or str(os.getpid() % 100000)
    octet = os.getpid() % 250 + 1
    a = Host(f"frl{tag}a", f"{SUBNET_PREFIX}.{octet}.1", f"frl{tag}a0")
    b = Host(f"frl{tag}b", f"{SUBNET_PREFIX}.{octet}.2", f"frl{tag}b0")
    try:
        for h in (a, b):
            _ip("netns", "add", h.name)
            _ip("-n", h.name, "link", "set", "lo", "up")
        _ip("link", "add", a.iface, "netns", a.name, "type", "veth", "peer", "name", b.iface, "netns", b.name)
        for h in (a, b):
            _ip("-n", h.name, "addr", "add", f"{h.ip}/24", "dev", h.iface)
            _ip("-n", h.name, "link", "set", h.iface, "up")
        yield a, b
    finally:
        for h in (a, b):
            h._cleanup()
        for h in (a, b):
            subprocess.run(["ip", "netns", "del", h.name], capture_output=True)


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")


def _kill_session(pid: int, grace_s: float = 5.0) -> None:
    """SIGTERM then SIGKILL to the process group led by `pid` (every process was started as a leader)."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                os.killpg(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


def live_group_members(pgid: int) -> list[int]:
    """PIDs in process group `pgid` that are still running (zombies awaiting their parent's reap excluded)."""
    alive = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(entry))
    return alive
