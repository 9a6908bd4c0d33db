"""RewardRunner: scores responses with per-call timeouts, so one stuck or crashing scorer cannot stall a step.

Each call runs on a worker (a daemon thread, or a process with `isolation="process"`) that talks to the
runner over a pipe; the runner sends an idle worker a batch of up to BATCH_SIZE calls (one at a time in small
passes), waits for replies with `multiprocessing.connection.wait`, and gives up on any call running longer than
`timeout_s`. The worker replies after each call and the runner restarts that worker's clock on every reply, so
`timeout_s` limits each call, not the batch: time spent queued behind batch-mates does not count. Before
starting each call the worker takes a claim (`workers.Claims`, shared with the runner under a lock), so the runner
can take back the calls a worker has not started, knowing exactly which those are. It does so whenever a
worker is idle, and deals them again in order, so a call waits behind a slow or hung batch-mate only while no
worker is free; when a call times out only that call fails and the rest of its batch is queued again.

Why not ThreadPoolExecutor: its worker threads are joined at interpreter exit, so one scorer stuck forever
would also block shutdown; and its futures cannot tell a queued call from a running one, so queue time would
count against the timeout. Limitation of thread isolation: a Python thread cannot be killed. A timed-out
thread is abandoned (it keeps running in the background until its call returns) and a fresh worker takes its
place; a scorer spinning on the CPU keeps holding the GIL share it had. With `isolation="process"` the
worker process of a timed-out call IS terminated. Process workers start with `mp_context` ("spawn" by default,
safe alongside CUDA/Ray threads); they resolve scorer specs themselves, so a scorer added to SCORERS at run
time in the parent is only seen by "fork" workers, and a script using process isolation needs the usual
`if __name__ == "__main__":` guard under spawn.

Isolation `auto` (the default) starts with threads, which cost nothing and see every scorer, and switches to
process workers the first time a call times out: from then on a timed-out call is terminated instead of
leaving a thread behind (busy threads finish the call they are in; the rest of their batches move to
processes). A scorer whose last HUNG_AFTER calls all timed out (none returned in between) is treated as hung
for the rest of the batch: its queued samples, and those not yet started in workers' batches, are not run and
count as failed. So a scorer that never returns costs about ceil(HUNG_AFTER / num_workers) × timeout_s per
batch, not one timeout per sample. A scorer that fails (error, timeout or skipped) on more than
`max_failure_rate` of its samples in a batch raises ScorerFailureError, as soon as that is certain, instead of
training on default scores.
"""
from __future__ import annotations

import logging
import math
import multiprocessing
import numbers
import time
import weakref
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler
from typing import Any

from fleetrl.rewards.errors import RewardError
from fleetrl.rewards.failures import HUNG_AFTER, MAX_ERROR_MESSAGES, RewardResult, Tally, check_failure_rate
from fleetrl.rewards.registry import SCORERS, RewardRouter
from fleetrl.rewards.workers import RewardWorker, close_all

logger = logging.getLogger("fleetrl.rewards")

ISOLATIONS = ("auto", "thread", "process")
# Calls sent to a worker in one message. A message per call cost a thread wake-up on each side of the pipe per
# sample (~0.1 ms on 2 cores: 256 cheap calls took ~25 ms); 16 gets most of the saving (64 was no faster), and
# keeps the calls running at once close together in the interleaved order (within num_workers × 16 positions).
BATCH_SIZE = 16
# Batches are at most a quarter of a worker's share of the pass, so a pass of under 8 × num_workers samples goes
# one call per message, exactly as the interleaved order says: in a batch a call can wait behind a hung one
# until an idle worker takes it over, and when every worker is stuck on a hang (a small pass where one prompt
# hangs) none is idle. Such passes have few round trips to save; the trainer's (hundreds) get BATCH_SIZE.
MIN_BATCHES_PER_WORKER = 4
# What a spawned worker can resolve: file specs and the builtins (names registered at run time exist only here).
_CHILD_SCORERS = frozenset(SCORERS)


@dataclass
class _Job:
    """The batch a worker is running: task indices in the order it runs them; the first `answered` replied."""

    worker: RewardWorker
    batch: list[int]
    # When the first unanswered call started as far as the runner can tell: the end of the dispatch pass that
    # sent the batch, or the call before it answered. Never earlier than the real start, so a call gets at least
    # timeout_s.
    since: float
    answered: int = 0

    @property
    def unanswered(self) -> list[int]:
        return self.batch[self.answered:]


class _Pass:
    """The state of one score() call: what is queued, what each worker holds, what came back."""

    def __init__(self, tasks: list[tuple], order: list[int], max_failure_rate: float, batch_size: int) -> None:
        self.tasks = tasks
        self.batch_size = batch_size
        self.rank = {i: r for r, i in enumerate(order)}  # queued tasks are kept in this order, requeued ones too
        self.outcomes: list[tuple[str, Any]] = [("error", "not run")] * len(tasks)
        self.todo: deque[int] = deque(order)
        self.busy: dict[Connection, _Job] = {}
        self.tally = Tally([t[0] for t in tasks], max_failure_rate)
        self.hung: set[str] = set()  # scorers found hung in this call: their remaining samples are skipped

    def spec(self, i: int) -> str:
        return self.tasks[i][0]


# ----------------------------------------------------------------------------------------------- runner
class RewardRunner:
    """Scores a batch of responses with the scorers `router` picks, num_workers calls at a time."""

    def __init__(self, router: RewardRouter, *, timeout_s: float = 10.0, default_score: float = 0.0,
                 num_workers: int = 4, isolation: str = "auto", mp_context: str = "spawn",
                 max_failure_rate: float = 1.0) -> None:
        if isolation not in ISOLATIONS:
            raise RewardError(f"rewards.isolation must be one of {ISOLATIONS}, got {isolation!r}")
        if not timeout_s > 0 or num_workers < 1:
            raise RewardError(f"rewards.timeout_s must be > 0 and rewards.num_workers >= 1; got "
                              f"timeout_s={timeout_s}, num_workers={num_workers}")
        if not 0.0 <= max_failure_rate <= 1.0:
            raise RewardError(f"rewards.max_failure_rate must be in [0, 1] (1 = never stop), got {max_failure_rate}")
        self.router = router
        self.timeout_s = timeout_s
        self.default_score = default_score
        self.num_workers = num_workers
        self.isolation = isolation
        self.max_failure_rate = max_failure_rate
        self._mp_context = mp_context
        self._ctx = multiprocessing.get_context(mp_context) if isolation == "process" else None
        self._idle: list[RewardWorker] = []
        self._logged: set[str] = set()
        self.num_abandoned_threads = 0
        # Stops idle worker processes when the runner is garbage collected without close().
        weakref.finalize(self, close_all, self._idle)

    def score(self, responses: list[str], ground_truths: list, data_sources: list[str],
              extra_infos: list[dict]) -> RewardResult:
        """One score per response; failures get `default_score` and are counted. Raises ScorerFailureError
        when a scorer fails on more than max_failure_rate of its samples (checked per call, i.e. per step)."""
        n = len(responses)
        if not (len(ground_truths) == len(data_sources) == len(extra_infos) == n):
            raise ValueError(f"RewardRunner.score: lengths differ (responses {n}, ground_truths "
                             f"{len(ground_truths)}, data_sources {len(data_sources)}, extra_infos {len(extra_infos)})")
        specs = [self.router.spec_for(ds) for ds in data_sources]
        tasks = [(s, r, g, e or {}) for s, r, g, e in zip(specs, responses, ground_truths, extra_infos)]
        result = self._collect(self._run(tasks, _interleaved([repr(g) for g in ground_truths])), specs, data_sources)
        check_failure_rate(result, self.max_failure_rate, f"per-sample limit rewards.timeout_s={self.timeout_s:g}")
        return result

    def close(self) -> None:
        close_all(self._idle)

    def __enter__(self) -> "RewardRunner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------- dispatching
    def _run(self, tasks: list[tuple], order: list[int]) -> list[tuple[str, Any]]:
        """("ok", value) | ("error", message) | ("timeout", on_thread) | ("skipped" | "abandoned", why) per task;
        tasks are dispatched in `order`."""
        st = _Pass(tasks, order, self.max_failure_rate, _batch_size(len(tasks), self.num_workers))
        while st.todo or st.busy:
            self._dispatch(st)
            if not st.busy:
                continue
            deadline = min(job.since for job in st.busy.values()) + self.timeout_s
            for conn in wait(list(st.busy), timeout=max(0.0, deadline - time.monotonic())):
                self._receive(st, conn)  # type: ignore[arg-type]
            for i in self._expire(st):
                self._escalate(st, st.spec(i))
                if st.tally.timed_out(st.spec(i)):
                    self._mark_hung(st, st.spec(i))
            if st.tally.certain_to_fail():  # the batch will raise anyway: stop paying for the rest of it
                self._abandon(st)
        return st.outcomes

    def _dispatch(self, st: _Pass) -> None:
        """Gives idle workers consecutive runs of the queue, after taking back the calls busy workers have not
        started: a call stuck behind a slow or hung one in a batch is run by the next idle worker, before the
        calls that come after it in the interleaved order."""
        self._fill_idle(min(self.num_workers - len(st.busy), len(st.todo)))
        if self._idle:  # the lowest-ranked unstarted calls go first, wherever they wait
            for conn, job in list(st.busy.items()):
                if len(job.unanswered) > 1:  # more than the call it may be running
                    self._take_back(st, conn, job)
        # Shrinks towards the end of the queue so that each idle worker gets a share.
        size = min(st.batch_size, math.ceil(len(st.todo) / self.num_workers))
        already = set(st.busy)
        while st.todo and self._idle:
            self._send(st, self._idle.pop(), [st.todo.popleft() for _ in range(min(size, len(st.todo)))])
        # One clock for the pass: its calls started no later than now (so each still gets at least timeout_s), and
        # calls sent together time out together. With a clock per send, a runner preempted between two sends saw
        # the first call time out alone, a few ms before the others; the next pass then started another call of a
        # scorer that hangs on all of them before their timeouts marked it hung (HUNG_AFTER): one timeout more,
        # and without a rate limit a round of timeout_s more, decided by sub-millisecond timing.
        now = time.monotonic()
        for conn in st.busy.keys() - already:
            st.busy[conn].since = now

    def _send(self, st: _Pass, worker: RewardWorker, batch: list[int]) -> None:
        try:
            message = (worker.claims.begin(len(batch)), [st.tasks[i] for i in batch])
            worker.conn.send(message)
        except OSError:  # the worker died while idle; drop it, a fresh one takes the batch next round
            worker.kill()
            self._requeue(st, batch)
        except Exception as exc:  # an argument did not pickle; nothing was written
            self._idle.append(worker)
            self._requeue(st, _drop_unsendable(st, batch, exc))
        else:
            st.busy[worker.conn] = _Job(worker, batch, since=0.0)  # set for the whole pass in _dispatch

    def _receive(self, st: _Pass, conn: Connection) -> None:
        """Reads every reply waiting on `conn`: the worker may have finished several calls since the last look."""
        job = st.busy[conn]
        while True:
            try:
                reply = conn.recv()
            except (EOFError, OSError) as exc:  # a reply stalled past timeout_s (bound_pipe_io) is BlockingIOError
                self._worker_died(st, conn, stalled=isinstance(exc, BlockingIOError))
                return
            i = job.batch[job.answered]
            job.answered += 1
            st.outcomes[i] = reply
            st.tally.returned(st.spec(i), failed=reply[0] != "ok")
            job.since = time.monotonic()  # the next call of the batch starts now: it gets its own timeout_s
            if job.answered == len(job.batch):
                del st.busy[conn]
                self._keep(job.worker)
                return
            if not conn.poll():
                return

    def _worker_died(self, st: _Pass, conn: Connection, stalled: bool = False) -> None:
        # Replies come in order, so the call it died in is the first unanswered one; the rest never started.
        job = st.busy.pop(conn)
        i, *rest = job.unanswered
        st.outcomes[i] = ("error", f"the reward worker stopped halfway through its reply for {self.timeout_s:g}s "
                                   f"(rewards.timeout_s; a frozen process) and was killed" if stalled else
                                   "the reward worker died during the call (crash or exit in the scorer)")
        st.tally.returned(st.spec(i), failed=True)
        job.worker.kill()
        self._requeue(st, rest)

    def _take_back(self, st: _Pass, conn: Connection, job: _Job) -> None:
        """Queues again the calls of `job` its worker has not started; frees the worker if it is between calls."""
        started = job.worker.claims.cut()
        if started is None or started >= len(job.batch):  # lock stuck (dead worker: wait() reports it) or all begun
            return
        unstarted, job.batch = job.batch[started:], job.batch[:started]
        self._requeue(st, unstarted)
        if job.answered == len(job.batch):
            del st.busy[conn]
            self._keep(job.worker)

    def _requeue(self, st: _Pass, indices: list[int]) -> None:
        """Puts tasks back in the queue at their place in the dispatch order; a hung scorer's are skipped."""
        back = []
        for i in indices:
            if st.spec(i) in st.hung:
                self._skip(st, i)
            else:
                back.append(i)
        if back:
            st.todo = deque(sorted([*st.todo, *back], key=st.rank.__getitem__))

    def _keep(self, worker: RewardWorker) -> None:
        if worker.is_thread and self._ctx is not None:  # escalated to processes while this call ran
            worker.close()
        else:
            self._idle.append(worker)

    def _fill_idle(self, want: int) -> None:
        try:
            fresh = [RewardWorker(self._ctx, io_timeout_s=self.timeout_s) for _ in range(want - len(self._idle))]
            for worker in fresh:  # started together, waited for together: spawn start-up overlaps
                worker.wait_ready()
        except RuntimeError:
            if self.isolation != "auto" or self._ctx is None:
                raise
            # e.g. a script without the `if __name__ == "__main__":` guard that spawn needs: keep threads.
            logger.warning("rewards.isolation=auto could not start reward worker processes; staying with threads "
                           "(a timed-out call keeps running in the background)")
            self._ctx = None
            fresh = [RewardWorker(None) for _ in range(want - len(self._idle))]
        self._idle.extend(fresh)

    def _expire(self, st: _Pass) -> list[int]:
        """Times out calls running longer than timeout_s and stops their workers; the unstarted rest of each such
        batch goes back to the queue. Returns the timed-out task indices."""
        now, expired = time.monotonic(), []
        for conn, job in list(st.busy.items()):
            if now - job.since < self.timeout_s or conn.poll():  # a reply that came since wait() is read next round
                continue
            del st.busy[conn]
            i, *rest = job.unanswered
            st.outcomes[i] = ("timeout", job.worker.is_thread)  # which kind decides what became of the call
            expired.append(i)
            job.worker.kill()  # a killed process starts nothing more; an abandoned thread exits at its next reply
            self.num_abandoned_threads += job.worker.is_thread
            self._requeue(st, rest)
        return expired

    def _escalate(self, st: _Pass, spec: str) -> None:
        """isolation=auto: after a timeout, new workers are processes, so the next timed-out call is killed."""
        if self.isolation != "auto" or self._ctx is not None or (":" not in spec and spec not in _CHILD_SCORERS):
            return
        logger.warning("a reward call timed out after %gs; rewards.isolation=auto now scores in worker processes "
                       "so that timed-out calls are terminated, not left running", self.timeout_s)
        close_all(self._idle)  # idle threads are replaced by processes as calls are dispatched
        self._ctx = multiprocessing.get_context(self._mp_context)
        for conn, job in list(st.busy.items()):  # busy threads finish their current call; the rest moves
            self._take_back(st, conn, job)

    def _mark_hung(self, st: _Pass, spec: str) -> None:
        st.hung.add(spec)
        queued, st.todo = list(st.todo), deque()
        self._requeue(st, queued)  # skips the hung scorer's tasks, keeps the others in order
        for conn, job in list(st.busy.items()):  # and its calls not yet started in workers' batches
            if any(st.spec(i) == spec for i in job.unanswered[1:]):
                self._take_back(st, conn, job)

    def _skip(self, st: _Pass, i: int) -> None:
        st.outcomes[i] = ("skipped", f"not run or stopped: the scorer timed out on {HUNG_AFTER} calls in a row in this batch")
        st.tally.skipped(st.spec(i))

    def _abandon(self, st: _Pass) -> None:
        # "abandoned", not "skipped": these samples' scorers did nothing wrong and are not counted as failing.
        # A hung scorer's own calls still count as its failures, whether they were running or queued: so the
        # count does not depend on which of its calls a worker happened to have started when the batch stopped.
        why = f"not run: the batch already failed rewards.max_failure_rate={self.max_failure_rate:g}"
        for job in st.busy.values():
            job.worker.kill()
            self.num_abandoned_threads += job.worker.is_thread
            for i in job.unanswered:
                self._stop(st, i, why)
        st.busy.clear()
        while st.todo:
            self._stop(st, st.todo.popleft(), why)

    def _stop(self, st: _Pass, i: int, why: str) -> None:
        if st.spec(i) in st.hung:
            self._skip(st, i)
        else:
            st.outcomes[i] = ("abandoned", why)

    # ---------------------------------------------------------------------------------------- results
    def _collect(self, outcomes: list[tuple[str, Any]], specs: list[str], sources: list[str]) -> RewardResult:
        result = RewardResult(scores=[])
        for i, (kind, value) in enumerate(outcomes):
            result.samples_by_scorer[specs[i]] = result.samples_by_scorer.get(specs[i], 0) + 1
            result.sources_by_scorer.setdefault(specs[i], set()).add(sources[i])
            if kind == "ok":
                try:
                    score, extras = _as_score(value)
                    result.scores.append(score)
                    result.extras.append(extras)
                    continue
                except TypeError as exc:
                    kind, value = "error", str(exc)
            result.scores.append(float(self.default_score))
            result.extras.append({})
            if kind == "abandoned":
                result.num_skipped += 1
                continue
            result.failed_by_scorer[specs[i]] = result.failed_by_scorer.get(specs[i], 0) + 1
            if kind == "timeout":
                result.num_timeouts += 1
                value = f"no result within {self.timeout_s}s" + self._abandon_note(on_thread=bool(value))
            elif kind == "skipped":
                result.num_skipped += 1
            else:
                result.num_errors += 1
            message = f"reward scorer {specs[i]!r} failed on sample {i} (data_source {sources[i]!r}): {value}"
            if len(result.errors) < MAX_ERROR_MESSAGES:
                result.errors.append(message)
            self._log_once(specs[i], message)
        return result

    def _abandon_note(self, on_thread: bool) -> str:
        if not on_thread:
            return " (its worker process was terminated)"
        return (f" (a thread cannot be killed: the call keeps running in the background, "
                f"{self.num_abandoned_threads} abandoned so far; rewards.isolation=process terminates it)")

    def _log_once(self, spec: str, message: str) -> None:
        if spec not in self._logged:
            self._logged.add(spec)
            logger.warning("%s; later failures of this scorer are counted in the reward metrics, not logged",
                           message)


def _interleaved(keys: list[str]) -> list[int]:
    """Sample indices reordered so that consecutive calls have different ground truths where the batch allows:
    [a, a, a, b, b, c] -> [a, b, c, a, b, a] (indices 0, 3, 5, 1, 4, 2). The n samples of one prompt then do not
    take every worker at once, so a scorer that hangs on one prompt's answer neither blocks the other prompts
    nor strings HUNG_AFTER timeouts together and gets mistaken for a scorer that hangs on everything."""
    seen: dict[str, int] = {}
    rank = []
    for key in keys:
        rank.append(seen.get(key, 0))
        seen[key] = rank[-1] + 1
    return sorted(range(len(keys)), key=lambda i: (rank[i], i))


def _batch_size(num_tasks: int, num_workers: int) -> int:
    """Calls per message for a pass: BATCH_SIZE, less in a small pass (see MIN_BATCHES_PER_WORKER)."""
    return max(1, min(BATCH_SIZE, num_tasks // (MIN_BATCHES_PER_WORKER * num_workers)))


def _drop_unsendable(st: _Pass, batch: list[int], exc: Exception) -> list[int]:
    """The tasks of `batch` that pickle; the others are marked failed (one bad sample must not fail its batch)."""
    sendable: list[int] = []
    for i in batch:
        try:
            ForkingPickler.dumps(st.tasks[i])
        except Exception as own:
            st.outcomes[i] = ("error", f"could not send the sample to a worker: {own}")
        else:
            sendable.append(i)
    if len(sendable) == len(batch):  # each pickles alone, the batch did not: fail them rather than retry forever
        for i in batch:
            st.outcomes[i] = ("error", f"could not send the sample to a worker: {exc}")
        return []
    return sendable


def _as_score(value: Any) -> tuple[float, dict]:
    """A scorer's return -> (score, extras); TypeError for anything that is not a finite number."""
    extras: dict = {}
    if isinstance(value, dict):
        if "score" not in value:
            raise TypeError(f"scorer returned a dict without a 'score' key (keys: {sorted(value)})")
        extras = {k: v for k, v in value.items() if k != "score"}
        value = value["score"]
    if isinstance(value, numbers.Real) and math.isfinite(float(value)):
        return float(value), extras
    raise TypeError(f"scorer returned {type(value).__name__} {str(value)[:40]!r}; expected a finite float, int or "
                    "bool, or a dict with a 'score' key")
