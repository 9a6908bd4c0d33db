"""RewardRunner: scores responses with per-call timeouts, so one stuck or crashing scorer cannot stall a step.

Each call runs on a worker (a daemon thread, or a process with `isolation="process"`) that talks to the
runner over a pipe; the runner sends a call to an idle worker, waits for replies with
`multiprocessing.connection.wait`, and gives up on any call running longer than `timeout_s`.

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
leaving a thread behind. A scorer whose last HUNG_AFTER calls all timed out (none returned in between) is
treated as hung for the rest of the batch: its queued samples are not run and count as failed. So a scorer
that never returns costs about ceil(HUNG_AFTER / num_workers) × timeout_s per batch, not one timeout per
sample. A scorer that fails (error, timeout or skipped) on more than `max_failure_rate` of its samples in a
batch raises ScorerFailureError, as soon as that is certain, instead of training on default scores.
"""
from __future__ import annotations

import logging
import math
import multiprocessing
import numbers
import signal
import threading
import time
import weakref
from collections import deque
from multiprocessing.connection import Connection, wait
from typing import Any

from fleetrl.rewards.errors import RewardError
from fleetrl.rewards.failures import HUNG_AFTER, MAX_ERROR_MESSAGES, RewardResult, Tally, check_failure_rate
from fleetrl.rewards.registry import SCORERS, RewardRouter, resolve_scorer

logger = logging.getLogger("fleetrl.rewards")

WORKER_START_TIMEOUT_S = 120.0  # a spawned worker re-imports Python modules; slow file systems take a while
ISOLATIONS = ("auto", "thread", "process")
# What a spawned worker can resolve: file specs and the builtins (names registered at run time exist only here).
_CHILD_SCORERS = frozenset(SCORERS)


# ---------------------------------------------------------------------------------------------- workers
def _serve(conn: Connection) -> None:
    """Worker loop: receive (spec, response, ground_truth, extra_info), reply ("ok", value) or ("error", msg)."""
    conn.send(("ready", None))
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        spec, response, ground_truth, extra_info = task
        try:
            reply: tuple[str, Any] = ("ok", resolve_scorer(spec)(response, ground_truth, extra_info))
        except (Exception, SystemExit) as exc:
            reply = ("error", f"{type(exc).__name__}: {exc}")
        try:
            _send_reply(conn, reply)
        except OSError:  # the runner gave up on this call (timeout) and closed our pipe
            return


def _send_reply(conn: Connection, reply: tuple[str, Any]) -> None:
    try:
        conn.send(reply)
    except OSError:  # a closed pipe is the caller's concern
        raise
    except Exception as exc:  # the value did not pickle; nothing was written, so the pipe is still usable
        conn.send(("error", f"scorer returned a value that cannot be sent back ({type(exc).__name__}: {exc})"))


def _serve_process(conn: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it then stops us
    _serve(conn)


class _Worker:
    """One thread or process running `_serve`; `conn` is the runner's end of its pipe."""

    def __init__(self, ctx: Any | None) -> None:
        self.conn, child = multiprocessing.Pipe() if ctx is None else ctx.Pipe()
        if ctx is None:
            self._proc = None
            threading.Thread(target=_serve, args=(child,), daemon=True, name="fleetrl-reward").start()
        else:
            self._proc = ctx.Process(target=_serve_process, args=(child,), daemon=True, name="fleetrl-reward")
            self._proc.start()
            child.close()

    @property
    def is_thread(self) -> bool:
        return self._proc is None

    def wait_ready(self) -> None:
        try:
            if not self.conn.poll(WORKER_START_TIMEOUT_S):
                raise EOFError
            self.conn.recv()
        except (EOFError, OSError) as exc:
            self.kill()
            raise RuntimeError("a reward worker process failed to start (see its traceback above); "
                               "try rewards.isolation=thread to debug") from exc

    def kill(self) -> None:
        """Terminates a process worker; a thread worker cannot be stopped, so it is cut loose instead."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.join()
        self.conn.close()  # an abandoned thread sees a closed pipe when its call returns, and exits

    def close(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        if self._proc is not None:
            self._proc.join(timeout=1.0)
            if self._proc.is_alive():
                self._proc.kill()
        self.conn.close()


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
        self._idle: list[_Worker] = []
        self._logged: set[str] = set()
        self.num_abandoned_threads = 0
        # Stops idle worker processes when the runner is garbage collected without close().
        weakref.finalize(self, _close_all, self._idle)

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
        _close_all(self._idle)

    def __enter__(self) -> "RewardRunner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------- dispatching
    def _run(self, tasks: list[tuple], order: list[int]) -> list[tuple[str, Any]]:
        """("ok", value) | ("error", message) | ("timeout", on_thread) | ("skipped" | "abandoned", why) per task;
        tasks are dispatched in `order`."""
        outcomes: list[tuple[str, Any]] = [("error", "not run")] * len(tasks)
        todo = deque(order)
        busy: dict[Connection, tuple[_Worker, int, float]] = {}
        tally = Tally([t[0] for t in tasks], self.max_failure_rate)
        while todo or busy:
            self._dispatch(tasks, todo, busy, outcomes)
            if not busy:
                continue
            deadline = min(start for _, _, start in busy.values()) + self.timeout_s
            for conn in wait(list(busy), timeout=max(0.0, deadline - time.monotonic())):
                worker, i, _ = busy.pop(conn)  # type: ignore[call-overload]
                try:
                    outcomes[i] = conn.recv()  # type: ignore[union-attr]
                    self._keep(worker)
                except (EOFError, OSError):
                    outcomes[i] = ("error", "the reward worker died during the call (crash or exit in the scorer)")
                    worker.kill()
                tally.returned(tasks[i][0], failed=outcomes[i][0] != "ok")
            for i in self._expire(busy, outcomes):
                self._escalate(tasks[i][0])
                if tally.timed_out(tasks[i][0]):
                    self._skip_hung(tasks[i][0], tasks, todo, outcomes, tally)
            if tally.certain_to_fail():  # the batch will raise anyway: stop paying for the rest of it
                self._abandon(busy, todo, outcomes)
        return outcomes

    def _dispatch(self, tasks: list[tuple], todo: deque, busy: dict, outcomes: list) -> None:
        self._fill_idle(min(self.num_workers - len(busy), len(todo)))
        while todo and self._idle:
            worker, i = self._idle.pop(), todo[0]
            try:
                worker.conn.send(tasks[i])
            except OSError:  # the worker died while idle; drop it, a fresh one takes the task next round
                worker.kill()
                continue
            except Exception as exc:  # an argument did not pickle; nothing was written
                outcomes[todo.popleft()] = ("error", f"could not send the sample to a worker: {exc}")
                self._idle.append(worker)
                continue
            busy[worker.conn] = (worker, todo.popleft(), time.monotonic())

    def _keep(self, worker: _Worker) -> None:
        if worker.is_thread and self._ctx is not None:  # escalated to processes while this call ran
            worker.close()
        else:
            self._idle.append(worker)

    def _fill_idle(self, want: int) -> None:
        try:
            fresh = [_Worker(self._ctx) for _ in range(want - len(self._idle))]
            for worker in fresh:  # started together, waited for together: spawn start-up overlaps
                worker.wait_ready()
        except RuntimeError:
            if self.isolation != "auto" or self._ctx is None:
                raise
            # e.g. a script without the `if __name__ == "__main__":` guard that spawn needs: keep threads.
            logger.warning("rewards.isolation=auto could not start reward worker processes; staying with threads "
                           "(a timed-out call keeps running in the background)")
            self._ctx = None
            fresh = [_Worker(None) for _ in range(want - len(self._idle))]
        self._idle.extend(fresh)

    def _expire(self, busy: dict, outcomes: list) -> list[int]:
        """Marks calls older than timeout_s as timed out, stops their workers; returns their task indices."""
        now, expired = time.monotonic(), []
        for conn, (worker, i, start) in list(busy.items()):
            if now - start >= self.timeout_s:
                del busy[conn]
                outcomes[i] = ("timeout", worker.is_thread)  # which kind decides what became of the call
                expired.append(i)
                worker.kill()
                self.num_abandoned_threads += worker.is_thread
        return expired

    def _escalate(self, spec: str) -> None:
        """isolation=auto: after a timeout, new workers are processes, so the next timed-out call is killed."""
        if self.isolation != "auto" or self._ctx is not None or (":" not in spec and spec not in _CHILD_SCORERS):
            return
        logger.warning("a reward call timed out after %gs; rewards.isolation=auto now scores in worker processes "
                       "so that timed-out calls are terminated, not left running", self.timeout_s)
        _close_all(self._idle)  # idle threads are replaced by processes as calls are dispatched
        self._ctx = multiprocessing.get_context(self._mp_context)

    def _skip_hung(self, spec: str, tasks: list, todo: deque, outcomes: list, tally: Tally) -> None:
        why = f"not run: the scorer timed out on {HUNG_AFTER} calls in a row in this batch"
        for i in [i for i in todo if tasks[i][0] == spec]:
            todo.remove(i)
            outcomes[i] = ("skipped", why)
            tally.skipped(spec)

    def _abandon(self, busy: dict, todo: deque, outcomes: list) -> None:
        # "abandoned", not "skipped": these samples' scorers did nothing wrong and are not counted as failing.
        why = f"not run: the batch already failed rewards.max_failure_rate={self.max_failure_rate:g}"
        for worker, i, _ in busy.values():
            worker.kill()
            self.num_abandoned_threads += worker.is_thread
            outcomes[i] = ("abandoned", why)
        busy.clear()
        while todo:
            outcomes[todo.popleft()] = ("abandoned", why)

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


def _close_all(workers: list[_Worker]) -> None:
    while workers:
        workers.pop().close()


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
