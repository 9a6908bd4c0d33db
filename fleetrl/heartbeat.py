"""A process-wide progress counter: long-running work calls `beat()` at each unit of progress (a decode step, a
micro-batch, a weight bucket), and the worker-call watchdog (cluster/watchdog.py) reads `count()` through the
worker's free concurrency slot. A call whose count stops moving for `cluster.stall_s` is a stall; a slow call
that keeps beating is never killed.

Fault injection for tests (environment variables, read once per process):
  FLEETRL_FAULT_BEAT_DELAY_S=S   sleep S seconds at every beat (a slow but progressing worker)
"""
from __future__ import annotations

import os
import time

_count = 0
_delay = float(os.environ.get("FLEETRL_FAULT_BEAT_DELAY_S", "0") or 0)


def beat() -> None:
    global _count
    _count += 1  # a lost increment between threads only delays a reading by one beat: no lock needed
    if _delay:
        time.sleep(_delay)


def count() -> int:
    return _count
