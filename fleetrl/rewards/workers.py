"""The worker side of RewardRunner (rewards/runner.py): a thread or process that runs scorer calls sent over a
pipe, and the claim counter it shares with the runner so the runner knows exactly which calls it has started."""
from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import struct
import threading
from multiprocessing.connection import Connection
from typing import Any

from fleetrl.rewards.registry import resolve_scorer
from fleetrl.rewards.scorers import Scorer

WORKER_START_TIMEOUT_S = 120.0  # a spawned worker re-imports Python modules; slow file systems take a while
# The runner's side of a claim lock waits at most this long: only a worker killed inside its few-instruction
# critical section holds it longer, and that worker is then treated as dead rather than hanging the runner.
CLAIM_LOCK_TIMEOUT_S = 5.0
KILL_JOIN_TIMEOUT_S = 5.0  # a SIGKILLed process is gone at once; past this it is left to the OS, not waited on


class Claims:
    """Which calls of its current batch a worker may still start, shared by the worker and the runner.

    The worker takes a claim before each call; the runner can withdraw the unclaimed rest at any moment (`cut`)
    and learns exactly how many were started, with no message to wait for and no race, since both sides change
    the state under one lock. Batches are numbered so that a worker still leaving a cut batch cannot take a
    claim of the next one."""

    def __init__(self, ctx: Any | None) -> None:
        # state: [batch number, calls started, calls allowed]; shared memory when the worker is a process.
        if ctx is None:
            self._lock: Any = threading.Lock()
            self._state: Any = [0, 0, 0]
        else:
            self._lock = ctx.Lock()
            self._state = ctx.RawArray("q", 3)

    def begin(self, size: int) -> int:
        """Runner, before sending a batch: allows its `size` calls; returns the number to send along with it."""
        if not self._lock.acquire(timeout=CLAIM_LOCK_TIMEOUT_S):
            raise OSError("the reward worker holds its claim lock: it died inside it")
        try:
            self._state[0] += 1
            self._state[1], self._state[2] = 0, size
            return self._state[0]
        finally:
            self._lock.release()

    def take(self, batch: int) -> bool:
        """Worker, before each call: may it start the next call of `batch`?"""
        with self._lock:
            if self._state[0] != batch or self._state[1] >= self._state[2]:
                return False
            self._state[1] += 1
            return True

    def cut(self) -> int | None:
        """Runner: lets no further call of the current batch start; returns how many started (None: unknown)."""
        if not self._lock.acquire(timeout=CLAIM_LOCK_TIMEOUT_S):
            return None
        try:
            self._state[2] = self._state[1]
            return self._state[1]
        finally:
            self._lock.release()


def _serve(conn: Connection, claims: Claims) -> None:
    """Worker loop: receive (batch number, [(spec, response, ground_truth, extra_info), ...]) and reply to each
    call it may start, in order, as it finishes: ("ok", value) or ("error", msg). None stops the worker."""
    conn.send(("ready", None))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None or not _serve_batch(conn, claims, *message):
            return


def _serve_batch(conn: Connection, claims: Claims, batch: int, tasks: list[tuple]) -> bool:
    """Runs the calls of a batch until done or cut; False when the runner has closed the pipe."""
    scorers: dict[str, Scorer] = {}  # resolved once per batch: resolving a file scorer stats the file
    for task in tasks:
        if not claims.take(batch):  # the runner took the rest back
            return True
        try:
            _send_reply(conn, _call(task, scorers))
        except OSError:  # the runner gave up on this worker (timeout) and closed our pipe
            return False
    return True


def _call(task: tuple, scorers: dict[str, Scorer]) -> tuple[str, Any]:
    spec, response, ground_truth, extra_info = task
    try:
        if spec not in scorers:
            scorers[spec] = resolve_scorer(spec)
        return ("ok", scorers[spec](response, ground_truth, extra_info))
    except (Exception, SystemExit) as exc:
        return ("error", f"{type(exc).__name__}: {exc}")


def _send_reply(conn: Connection, reply: tuple[str, Any]) -> None:
    try:
        conn.send(reply)
    except OSError:  # a closed pipe is the caller's concern
        raise
    except Exception as exc:  # the value did not pickle; nothing was written, so the pipe is still usable
        conn.send(("error", f"scorer returned a value that cannot be sent back ({type(exc).__name__}: {exc})"))


def _serve_process(conn: Connection, claims: Claims) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it then stops us
    _serve(conn, claims)


def bound_pipe_io(conn: Connection, seconds: float) -> None:
    """A send or receive on the runner's end of a process worker's pipe fails (OSError) after `seconds` without
    progress, instead of blocking the trainer's thread. A batch larger than the pipe's buffer blocks the send
    until the worker reads it, and a reply is read whole once its first bytes arrive: a worker frozen while idle,
    or halfway through a reply (SIGSTOP, a cgroup freezer), would hold the runner forever. The pipe is a
    socketpair (multiprocessing's duplex Pipe on POSIX), and the options set on a duplicate of its descriptor
    apply to the socket itself."""
    timeval = struct.pack("ll", int(seconds), int(seconds % 1 * 1e6))
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)


class RewardWorker:
    """One thread or process running `_serve`; `conn` is the runner's end of its pipe."""

    def __init__(self, ctx: Any | None, io_timeout_s: float | None = None) -> None:
        self.conn, child = multiprocessing.Pipe() if ctx is None else ctx.Pipe()
        if ctx is not None and io_timeout_s:
            bound_pipe_io(self.conn, io_timeout_s)
        self.claims = Claims(ctx)
        if ctx is None:
            self._proc = None
            threading.Thread(target=_serve, args=(child, self.claims), daemon=True, name="fleetrl-reward").start()
        else:
            self._proc = ctx.Process(target=_serve_process, args=(child, self.claims), daemon=True,
                                     name="fleetrl-reward")
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
            self._proc.join(timeout=KILL_JOIN_TIMEOUT_S)
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


def close_all(workers: list[RewardWorker]) -> None:
    while workers:
        workers.pop().close()
