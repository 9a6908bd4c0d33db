"""The worker-call watchdog: every call on a Ray worker has a deadline, and a call that stops making progress is
found, named and turned into an error the supervisor recovers from — never waited on.

Progress is read on a side channel: each worker actor has one free concurrency slot, where `Worker.progress`
answers the process's heartbeat count (fleetrl/heartbeat.py: decode steps, micro-batches, weight buckets). A
worker whose count has not moved — or that has not answered at all (a SIGSTOPped process, a frozen node) — for
`cluster.stall_s` is stalled. A slow worker that keeps beating is left alone until the call's deadline.
The first call of each verb compiles kernels (flex attention, torch.compile, Triton autotuning) for minutes
without a tick, so there a worker that still answers its pings gets `cluster.first_call_stall_s`; one that stops
answering (a frozen process or node) is still a stall after `stall_s`.

Deadlines (`cluster.call_timeout_s`): `auto` allows `cluster.first_call_timeout_s` for the first call of each verb
(model load, compile, CUDA-graph capture) and afterwards max(floor, 5 × the slowest of its last 10 durations);
a number fixes it; `cluster.call_timeouts` overrides per verb.

On a stall or a deadline the error names pool, rank, node, pid, phase and the seconds it waited, and is logged at
once; then the Python stacks of the call's workers are dumped (py-spy, on their own node) under RUN_DIR/stalls/step_N/
within DUMP_DEADLINE_S in all, so a frozen node, which never runs its dump, delays the error by that much at most.
"""
from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import time
from collections import defaultdict, deque
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import ray

from fleetrl.config.schema import ClusterConfig

AUTO_FACTOR, AUTO_HISTORY, AUTO_FLOOR_S = 5.0, 10, 300.0
# All of a stall's stack dumps together. py-spy reads a live process in well under a second; a dump that has not
# come back by then is on a frozen node (its task never runs) and must not hold up the error: the run's recovery
# waits on the error, and Ray's own node-death verdict (about a minute) would otherwise come first.
DUMP_DEADLINE_S = 5.0

log = logging.getLogger("fleetrl.cluster")


class StallError(RuntimeError):
    """A worker made no progress (or missed its deadline); recoverable like a lost worker.

    `unresponsive`: node id -> ip of each node the diagnosis could not reach (its stack dump task never ran). Ray
    reports such a frozen node alive until its health checks fail; the supervisor waits for that before it places
    anything again (cluster/health.py: wait_until_declared)."""

    def __init__(self, message: str, unresponsive: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.unresponsive = dict(unresponsive or {})


@dataclass(frozen=True)
class StackDump:
    """One worker's stacks, and whether the dump ran on its node (False: the node is dead, or frozen itself)."""
    text: str
    reached: bool = True


@dataclass(frozen=True)
class Call:
    ref: Any
    handle: Any
    pool: str
    rank: int
    info: dict  # Worker.node_info of the worker: ip, pid, node_id


# The rank-local step's verbs (workers/local_step.py) and the driver-path verb of the same phase, so that
# cluster.call_timeouts={generate: 900} bounds a colocated plan's rollout as it does a separate pool's.
SAME_PHASE = {"rollout_local": "generate", "prepare_local": "compute_logprobs",
              "update_actor_local": "update_actor", "update_critic_local": "update_critic"}


@dataclass
class Deadlines:
    """Per-verb call deadlines from recent durations (see module docstring)."""
    cfg: ClusterConfig
    history: dict[str, deque] = field(default_factory=lambda: defaultdict(lambda: deque(maxlen=AUTO_HISTORY)))

    def of(self, verb: str) -> float:
        for name in (verb, SAME_PHASE.get(verb)):  # the rank-local verbs honour their phase's deadline too
            if name in self.cfg.call_timeouts:
                return float(self.cfg.call_timeouts[name])
        if self.cfg.call_timeout_s != "auto":
            return float(self.cfg.call_timeout_s)
        seen = self.history[verb]
        if not seen:
            return self.cfg.first_call_timeout_s
        return max(AUTO_FLOOR_S, AUTO_FACTOR * max(seen))

    def first(self, verb: str) -> bool:
        """No call of this verb has finished yet (its first call loads, compiles and captures)."""
        return not self.history[verb]

    def record(self, verb: str, seconds: float) -> None:
        self.history[verb].append(seconds)


def stall_limit(stall_s: float, first_call_stall_s: float | None, answered_ago_s: float) -> float:
    """Seconds without a progress tick that make a stall: `first_call_stall_s` (when given: the first call of a
    verb) while the worker still answers pings (answered within the last stall_s), else stall_s."""
    if first_call_stall_s is not None and answered_ago_s <= stall_s:
        return max(stall_s, first_call_stall_s)
    return stall_s


def stall_reason(idle_s: float, limit_s: float, stall_s: float) -> str:
    if limit_s == stall_s:
        return f"made no progress for {idle_s:.0f}s (cluster.stall_s={limit_s:g})"
    return f"made no progress for {idle_s:.0f}s (cluster.first_call_stall_s={limit_s:g}: the verb's first call)"


def watch(calls: list[Call], *, verb: str, timeout_s: float, stall_s: float, stall_dir: Path | None,
          step: int, first_call_stall_s: float | None = None) -> list[Any]:
    """ray.get of every call, failing fast on the first error, and raising StallError on a stall or deadline."""
    start = time.monotonic()
    last_move = {i: start for i in range(len(calls))}
    last_answer = dict(last_move)
    last_count: dict[int, int] = {}
    pings: dict[int, Any] = {}
    pending = {c.ref: i for i, c in enumerate(calls)}
    poll = max(0.05, min(1.0, stall_s / 4))
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=poll)
        for ref in ready:
            ray.get(ref)  # raises the worker's own error now, even while other ranks block in a collective
            pending.pop(ref)
        if not pending:
            break
        now = time.monotonic()
        _read_pings(calls, pending.values(), pings, last_count, last_move, now, last_answer)
        limits = {i: stall_limit(stall_s, first_call_stall_s, now - last_answer[i]) for i in pending.values()}
        stuck = [i for i in pending.values() if now - last_move[i] > limits[i]]
        if stuck or now - start > timeout_s:
            why = (stall_reason(now - last_move[stuck[0]], limits[stuck[0]], stall_s) if stuck
                   else f"did not finish within the call deadline of {timeout_s:.0f}s (cluster.call_timeout_s)")
            culprits = [calls[i] for i in (stuck or sorted(pending.values()))]
            raise _diagnose(culprits, calls, verb, why, start, stall_dir, step)
    return ray.get([c.ref for c in calls])


def _read_pings(calls: list[Call], running, pings: dict[int, Any], last_count: dict[int, int],
                last_move: dict[int, float], now: float, last_answer: dict[int, float] | None = None) -> None:
    """One outstanding progress ping per running worker; a count that moved resets its stall clock, and an
    answer (moved or not) is recorded in `last_answer`."""
    for i in running:
        if i not in pings:
            pings[i] = calls[i].handle.progress.remote()
    done, _ = ray.wait(list(pings.values()), num_returns=len(pings), timeout=0)
    done = set(done)
    for i, ref in list(pings.items()):
        if ref not in done:
            continue  # unanswered: a frozen process never answers, so its clock keeps running
        del pings[i]
        try:
            count = ray.get(ref)
        except ray.exceptions.RayError:
            continue
        if last_answer is not None:
            last_answer[i] = now
        if last_count.get(i) != count:
            last_count[i], last_move[i] = count, now


def _diagnose(culprits: list[Call], calls: list[Call], verb: str, why: str, start: float, stall_dir: Path | None,
              step: int) -> StallError:
    """The StallError for `culprits`, `start` being when the wait began (time.monotonic). The stall is logged before
    the stack dump, and the seconds waited are taken after it: the message says what the caller really waited."""
    first = culprits[0]
    names = ", ".join(f"rank {c.rank} (node {c.info.get('ip', '?')}, pid {c.info.get('pid', '?')})" for c in culprits)
    head = f"pool '{first.pool}' {names} {why} in phase '{verb}' at step {step}"
    log.error("%s; dumping its stacks (at most %gs)", head, DUMP_DEADLINE_S)
    lines: list[str] = []
    unresponsive: dict[str, str] = {}
    dump_s = 0.0
    if stall_dir is not None:
        stall_dir.mkdir(parents=True, exist_ok=True)
        top = ""
        t0 = time.monotonic()
        # every worker of the call: the stuck one, and where its peers wait for it; dumped at once, under one
        # deadline, so a frozen node costs DUMP_DEADLINE_S whatever the number of workers on it
        dumps = dump_stacks([c.info for c in calls])
        dump_s = time.monotonic() - t0
        for c, dump in zip(calls, dumps):
            (stall_dir / f"{c.pool}_r{c.rank}.txt").write_text(dump.text)
            if not dump.reached and c.info.get("node_id"):
                unresponsive[c.info["node_id"]] = c.info.get("ip", "?")
            if c is first:
                top = _top_frames(dump.text)
        lines.append(f"top frames of rank {first.rank}: {top or 'unavailable'}")
        lines.append(f"full stacks: {stall_dir}/")
    waited = f"waited {time.monotonic() - start:.0f}s" + (f" (the stack dump {dump_s:.1f}s of it)" if dump_s else "")
    lines.insert(0, f"{head}; {waited}.")
    lines.append("the supervisor recovers from the last checkpoint when trainer.max_restarts allows; see docs/hangs.md")
    return StallError("\n".join(lines), unresponsive)


def dump_stacks(infos: list[dict], deadline_s: float = DUMP_DEADLINE_S) -> list[StackDump]:
    """`dump_stack` of every worker concurrently, all within `deadline_s`; a worker on a node Ray already reports
    dead is not waited for at all, and one whose dump is not back by the deadline is reported as unreached."""
    dead = _dead_nodes()

    def one(info: dict) -> StackDump:
        if info.get("node_id") in dead:
            return StackDump(f"node {info.get('ip')} is dead (Ray reports it lost): no stack of pid {info.get('pid')}",
                             reached=False)
        return dump_stack(info, deadline_s)

    pool = ThreadPoolExecutor(max_workers=max(1, min(64, len(infos))), thread_name_prefix="fleetrl-stack-dump")
    futures = [pool.submit(one, info) for info in infos]
    wait(futures, timeout=deadline_s + 0.5)
    # not waiting for stragglers: each bounds itself by deadline_s (py-spy's and ray.get's own timeouts)
    pool.shutdown(wait=False, cancel_futures=True)
    return [f.result() if f.done() and not f.cancelled() else _unreached(info, deadline_s)
            for f, info in zip(futures, infos)]


def _unreached(info: dict, deadline_s: float) -> StackDump:
    return StackDump(f"could not reach node {info.get('ip')} to dump pid {info.get('pid')} within {deadline_s:g}s: the "
                     f"node itself is unresponsive (frozen, or overloaded)", reached=False)


def _dead_nodes() -> set[str]:
    try:
        return {n["NodeID"] for n in ray.nodes() if not n.get("Alive", True)}
    except Exception:  # noqa: BLE001 — the diagnosis must not fail for want of the node table
        return set()


def dump_stack(info: dict, timeout_s: float = DUMP_DEADLINE_S) -> StackDump:
    """Python stacks of a worker process via py-spy, run on the worker's own node (a Ray task pinned there when it
    is not this node). --nonblocking reads a stopped or hung process without pausing it further."""
    pid = info.get("pid")
    if pid is None:
        return StackDump("no pid known for this worker")
    if info.get("node_id") in ("", None, ray.get_runtime_context().get_node_id()):
        return StackDump(_py_spy(int(pid), timeout_s))
    from fleetrl.cluster.placement import pinned_to

    task = ray.remote(_py_spy).options(**pinned_to(info["node_id"]))
    try:
        return StackDump(ray.get(task.remote(int(pid), timeout_s), timeout=timeout_s))
    except Exception as e:  # noqa: BLE001 — a frozen node cannot run the task: say so, do not wait
        return StackDump(f"could not reach node {info.get('ip')} to dump pid {pid} ({type(e).__name__}): the node "
                         f"itself is unresponsive", reached=False)


def _py_spy(pid: int, timeout_s: float) -> str:
    try:
        out = subprocess.run([_py_spy_path(), "dump", "--nonblocking", "--pid", str(pid)], capture_output=True,
                             text=True, timeout=timeout_s)
        return out.stdout or out.stderr
    except FileNotFoundError:
        return "py-spy is not installed (pip install py-spy) — no stack available"
    except subprocess.TimeoutExpired:
        return f"py-spy did not finish within {timeout_s:g}s for pid {pid}"


def _py_spy_path() -> str:
    """py-spy on PATH, else beside this Python (a virtual environment that was never activated)."""
    beside = Path(sys.executable).parent / "py-spy"
    return shutil.which("py-spy") or (str(beside) if beside.exists() else "py-spy")


def _top_frames(dump: str, n: int = 3) -> str:
    """The innermost `n` frames of the thread doing the work in a py-spy dump, with its thread line, joined by " | ".

    A Ray actor runs its methods in threads of their own while the main thread idles in Ray's main loop, so the
    first thread is the wrong one to show: see `busy_thread`."""
    thread = busy_thread(_threads(dump))
    if thread is None:
        return ""
    title, frames = thread
    return " | ".join(frames[:n]) + f" [{title}]"


def _threads(dump: str) -> list[tuple[str, list[str]]]:
    """(thread line, its frames innermost first) of each thread of a py-spy dump."""
    threads: list[tuple[str, list[str]]] = []
    for line in dump.splitlines():
        if line.startswith("Thread "):
            threads.append((line.strip().rstrip(":"), []))
        elif threads and line.startswith("    ") and "(" in line:
            threads[-1][1].append(line.strip())
    return threads


def busy_thread(threads: list[tuple[str, list[str]]]) -> tuple[str, list[str]] | None:
    """The thread that runs the stuck call: one running an actor method (Ray's `actor_method_executor` frame) other
    than the watchdog's own `progress` ping; else one py-spy saw on the CPU ("active"); else the first with frames.
    A SIGSTOPped process shows every thread idle, so the method frame, not py-spy's activity mark, decides."""
    with_frames = [t for t in threads if t[1]]

    def runs_method(frames: list[str]) -> bool:
        return (any("actor_method_executor" in f for f in frames)
                and not any(f.startswith(("_RayWorker.progress ", "Worker.progress ")) for f in frames))

    for pick in (lambda t: runs_method(t[1]), lambda t: "(active" in t[0], lambda t: True):
        found = [t for t in with_frames if pick(t)]
        if found:
            return found[0]
    return None
