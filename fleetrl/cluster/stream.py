"""Calls started one at a time on single workers of a group and collected as they finish (the async pipeline's
generate calls), under the same watchdog rules as `watch` (cluster/watchdog.py): a worker whose heartbeat has not
moved for cluster.stall_s, or whose call runs past its verb's deadline, is a StallError naming pool, rank and
phase, with stacks dumped; a dead worker is a WorkerLostError. Either is recovered by the supervisor.

A worker runs its calls one after another (the rollout's serial concurrency group), so a call's deadline counts
from when the worker finished its previous call (or from submission, whichever is later), not from submission:
a call queued behind k others is not late for waiting. With trainer.stream_rollouts the calls run side by side in
the worker's one engine loop: the same rule then counts from the last call that finished, which is lenient (a call
waiting for slots is not late), while the heartbeat, which the loop moves at every decode round, still finds a
frozen worker; `busy_s` then sums overlapping calls.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterator

import ray

from fleetrl.cluster.group import WorkerGroup, WorkerLostError
from fleetrl.cluster.watchdog import Call, _diagnose, _read_pings, stall_limit, stall_reason


@dataclass
class _Pending:
    rank: int
    verb: str
    submitted: float


class Stream:
    def __init__(self, group: WorkerGroup) -> None:
        self.group = group
        self.pending: dict[Any, _Pending] = {}  # ref -> call, in submission order
        self.last_done = [0.0] * group.world_size
        self.waited_s = 0.0
        """Seconds spent blocked in `wait` (the caller's idle time), accumulated; the caller resets it."""
        self.busy_s = [0.0] * group.world_size
        """In-worker seconds of the calls collected, per rank, accumulated; the caller resets it."""
        # The stall clock of each rank lives across waits: results of other ranks must not reset it.
        self.pings: dict[int, Any] = {}
        self.last_count: dict[int, int] = {}
        self.last_move: dict[int, float] = {}
        self.last_answer: dict[int, float] = {}
        self.finished: set[Any] = set()
        """Refs seen finished while the caller waited on others, not yet collected."""

    def submit(self, rank: int, method: Callable, *args: Any) -> Any:
        now = time.monotonic()
        if not self._has_pending(rank):
            self.last_move[rank] = self.last_answer[rank] = now  # an idle worker's clocks start with its new call
        ref = self.group.submit(rank, method, *args)
        self.pending[ref] = _Pending(rank, method.__name__, now)
        return ref

    def wait(self, refs: Collection[Any]) -> dict[Any, Any]:
        """Blocks until at least one of `refs` (pending calls of this stream) finished; returns {ref: result} of
        every one of them that has, and forgets those."""
        assert refs and all(r in self.pending for r in refs), "wait on calls this stream submitted"
        c = self.group.plan.config.cluster
        poll = max(0.05, min(1.0, c.stall_s / 4))
        start = time.monotonic()
        calls = self._calls()
        while True:
            ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=poll)
            if ready:
                self.waited_s += time.monotonic() - start
                return {ref: self._collect(ref) for ref in ready}
            now = time.monotonic()
            busy = self._running(refs, now)
            _read_pings(calls, busy, self.pings, self.last_count, self.last_move, now, self.last_answer)
            self._check(calls, busy, now, start)

    def _collect(self, ref: Any) -> Any:
        call = self.pending.pop(ref)
        seen = ref in self.finished
        self.finished.discard(ref)
        try:
            out, seconds = ray.get(ref)
        except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError) as e:
            raise WorkerLostError(f"pool '{self.group.pool.name}': a worker died: {e}") from e
        now = time.monotonic()
        self.group.deadlines.record(call.verb, seconds)
        if not seen:  # one seen finished earlier moved its rank's clocks then: the next call is running since
            self.last_done[call.rank] = self.last_move[call.rank] = now
        self.busy_s[call.rank] += seconds
        return out

    def _check(self, calls: list[Call], busy: list[int], now: float, start: float) -> None:
        c = self.group.plan.config.cluster
        last_move = self.last_move
        first = {i: c.first_call_stall_s if self.group.deadlines.first(self._head(i).verb) else None for i in busy}
        limits = {i: stall_limit(c.stall_s, first[i], now - self.last_answer.get(i, now)) for i in busy}
        stuck = [i for i in busy if now - last_move[i] > limits[i]]
        late = [i for i in busy if now - self._head_start(i) > self.group.deadlines.of(self._head(i).verb)]
        if not stuck and not late:
            return
        i = (stuck or late)[0]
        why = (stall_reason(now - last_move[i], limits[i], c.stall_s) if stuck else
               f"did not finish within the call deadline of {self.group.deadlines.of(self._head(i).verb):.0f}s "
               f"(cluster.call_timeout_s)")
        raise _diagnose([calls[j] for j in (stuck or late)], calls, self._head(i).verb, why, start,
                        self.group.stall_dir(), self.group.step)

    def _calls(self) -> list[Call]:
        """One watchdog Call per rank (the ref is unused: pings and diagnosis go by worker)."""
        return self.group.calls([None] * self.group.world_size)

    def _running(self, waited: Collection[Any], now: float) -> list[int]:
        """Ranks with a call not yet finished. A rank whose calls all finished while the caller waits on other refs
        (load_engines waits on its loads; a generate queued before one may be done, its result not yet collected)
        is idle: its heartbeat stands still, and counting it would report a healthy worker as stuck. A call seen
        finished here ends its rank's previous call for the next one's deadline, as a collected one does."""
        others = [r for r in self.pending if r not in waited and r not in self.finished]
        for ref in ray.wait(others, num_returns=len(others), timeout=0)[0] if others else []:
            self.finished.add(ref)
            rank = self.pending[ref].rank
            self.last_done[rank] = self.last_move[rank] = now
        return sorted({p.rank for p in self._unfinished()})

    def _unfinished(self) -> Iterator[_Pending]:
        """Pending calls not seen finished (running, or queued behind one), in submission order."""
        return (p for r, p in self.pending.items() if r not in self.finished)

    def _has_pending(self, rank: int) -> bool:
        """Whether the rank has a call not seen finished (one running, or queued behind it)."""
        return any(p.rank == rank for p in self._unfinished())

    def _head(self, rank: int) -> _Pending:
        """The rank's running call: its first pending one not seen finished."""
        return next(p for p in self._unfinished() if p.rank == rank)

    def _head_start(self, rank: int) -> float:
        return max(self._head(rank).submitted, self.last_done[rank])

    def take_times(self) -> tuple[float, list[float]]:
        """(seconds blocked in wait, per-rank busy seconds) since the last call, and reset."""
        out = (self.waited_s, list(self.busy_s))
        self.waited_s, self.busy_s = 0.0, [0.0] * self.group.world_size
        return out
