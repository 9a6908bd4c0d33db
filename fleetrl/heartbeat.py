"""A process-wide progress counter: long-running work calls `beat()` at each unit of progress (a decode step, a
micro-batch, a weight bucket), and the worker-call watchdog (cluster/watchdog.py) reads `count()` through the
worker's free concurrency slot. A call whose count stops moving for `cluster.stall_s` is a stall; a slow call
that keeps beating is never killed.

Fault injection for tests (environment variables, read once per process):
  FLEETRL_FAULT_BEAT_DELAY_S=S   sleep S seconds at every beat (a slow but progressing worker)
  FLEETRL_FAULT_STOP=VERB:N:FILE the N-th call of worker verb VERB SIGSTOPs its own process (a frozen worker),
                                 once per FILE (created when it fires), so a rebuilt worker does not freeze again
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator

_count = 0
_delay = float(os.environ.get("FLEETRL_FAULT_BEAT_DELAY_S", "0") or 0)


def beat() -> None:
    global _count
    _count += 1  # a lost increment between threads only delays a reading by one beat: no lock needed
    if _delay:
        time.sleep(_delay)


def count() -> int:
    return _count


@contextlib.contextmanager
def beating(every_s: float = 1.0) -> Iterator[None]:
    """Beats every `every_s` while the block runs, for work with no unit of progress to count: one torch.save
    of a large optimiser state, a load from slow storage. A frozen process (SIGSTOP, a dead host) stops its
    threads too, so the stall check still finds it; a thread stuck in I/O is left to the verb's call deadline
    (cluster.call_timeout_s), which a beat does not extend."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(every_s):
            beat()

    thread = threading.Thread(target=loop, daemon=True, name="fleetrl-beating")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=every_s + 1)


_calls: dict[str, int] = {}


def maybe_freeze(verb: str) -> None:
    """The FLEETRL_FAULT_STOP hook (see the module docstring); a no-op unless that variable is set."""
    spec = os.environ.get("FLEETRL_FAULT_STOP")
    if not spec:
        return
    want, n, marker = spec.split(":", 2)
    _calls[verb] = _calls.get(verb, 0) + 1
    if verb == want and _calls[verb] == int(n) and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGSTOP)
