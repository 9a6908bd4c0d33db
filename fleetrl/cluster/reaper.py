"""Ends what a driver's own local Ray leaves behind when the driver dies without shutting it down (SIGKILL, OOM).

`ray.init(address="local")` starts the GCS and the raylet as the driver's children, and they die with it (Ray's
fate sharing). The raylet's DashboardAgent and RuntimeEnvAgent do not: they are re-parented to init and live on, two
processes per killed run (Ray 2.60, issue 41). `ensure_ray` starts this reaper right after it started such a Ray: a
detached process in a session of its own (a signal to the driver's process group does not reach it). While the
driver and the raylet live, it notes every descendant of the raylet (the agents, the workers) by PID and start time;
once either is gone it gives Ray's own shutdown `GRACE_S` to finish, then SIGKILLs what is left of that one Ray node,
and exits. It kills only:
- the processes the driver started (the GCS, the raylet, ...) and the raylet's descendants it saw, each by PID and
  start time, so a recycled PID is never hit;
- processes of this user whose environment still shows the node's `RAY_NODE_ID` (which the raylet sets for what it
  starts): one started after the last look. Not reliable on its own: a process that renames itself (setproctitle)
  may overwrite the start of its environment block. A node id is unique to one Ray session: no other Ray is touched.

It runs as a script (`python -I reaper.py ...`) with the standard library only: it must not import ray or fleetrl,
whose import costs a second and whose state it does not need.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

GRACE_S = 3.0  # a clean ray.shutdown() ends the agents itself within about a second
POLL_S = 0.5
Proc = tuple[int, int]  # (pid, start ticks): one process, never a later one that reuses its PID


def start_ticks(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat (start time since boot); None when the process is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # fields after "(comm)" start at field 3
    return None if fields[0] == "Z" else int(fields[19])


def alive(proc: Proc) -> bool:
    return start_ticks(proc[0]) == proc[1]


def node_processes(node_id: str) -> list[Proc]:
    """This user's processes whose environment has RAY_NODE_ID=node_id (other users' cannot be read anyway)."""
    marker = f"RAY_NODE_ID={node_id}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if entry.stat().st_uid != os.getuid() or marker not in (entry / "environ").read_bytes().split(b"\0"):
                continue
        except OSError:  # exited meanwhile, or not ours to read
            continue
        ticks = start_ticks(int(entry.name))
        if ticks is not None:
            found.append((int(entry.name), ticks))
    return found


def descendants(roots: set[int]) -> list[Proc]:
    """Every process below `roots` (children, their children, ...), from one scan of /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # exited meanwhile
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found: list[Proc] = []
    frontier = list(roots)
    while frontier:
        for child in children.get(frontier.pop(), []):
            ticks = start_ticks(child)
            if ticks is not None and child not in roots and (child, ticks) not in found:
                found.append((child, ticks))
                frontier.append(child)
    return found


def reap(node_id: str, known: list[Proc], grace_s: float = GRACE_S) -> list[int]:
    """Waits up to grace_s for the node's processes to end by themselves, then SIGKILLs the rest; their PIDs."""
    deadline = time.monotonic() + grace_s
    while True:
        left = [p for p in known if alive(p)] + node_processes(node_id)
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    killed = []
    for pid, ticks in dict(left).items():
        if start_ticks(pid) == ticks:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
    return killed


def watch(driver: Proc, raylet: Proc, node_id: str, started: list[Proc]) -> list[int]:
    """Notes the raylet's descendants while both the driver and its raylet live; then reaps the node."""
    known = dict(started)
    while alive(driver) and alive(raylet):
        known.update(descendants({raylet[0]}))
        time.sleep(POLL_S)
    return reap(node_id, list(known.items()))


def command(driver: Proc, raylet: Proc, node_id: str, started: list[Proc]) -> list[str]:
    """The command line that starts a reaper for one node (see the module docstring)."""
    def fmt(p: Proc) -> str:
        return f"{p[0]}:{p[1]}"
    return [sys.executable, "-I", str(Path(__file__).resolve()), "--driver", fmt(driver), "--raylet", fmt(raylet),
            "--node-id", node_id, *(a for p in started for a in ("--started", fmt(p)))]


def _proc(text: str) -> Proc:
    pid, ticks = text.split(":")
    return int(pid), int(ticks)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--driver", type=_proc, required=True)
    ap.add_argument("--raylet", type=_proc, required=True)
    ap.add_argument("--node-id", required=True)
    ap.add_argument("--started", type=_proc, action="append", default=[])
    args = ap.parse_args(argv)
    # Detach: the parent returns at once to the driver (which waits for it), the child is re-parented to init and
    # leads its own session, so neither the driver's exit nor a kill of its process group ends it.
    if os.fork() > 0:
        return 0
    os.setsid()
    watch(args.driver, args.raylet, args.node_id, args.started)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
