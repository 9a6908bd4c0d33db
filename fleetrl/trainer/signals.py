"""Stopping on request: the first SIGINT (Ctrl-C) or SIGTERM (SLURM and Kubernetes preemption) lets the current
step finish, checkpoints it (unless trainer.save_last is off) and stops with a message saying how to continue; a
second signal stops at once, without that checkpoint."""
from __future__ import annotations

import signal
import sys
import threading
from types import FrameType


class Interrupted(Exception):
    """The run stopped on a signal after step `step`; `exit_code` is 128 + the signal number."""

    def __init__(self, step: int, signum: int, checkpoint_step: int | None) -> None:
        self.step, self.signum, self.checkpoint_step = step, signum, checkpoint_step
        self.exit_code = 128 + signum
        last = f"step {checkpoint_step}" if checkpoint_step is not None else "none"
        super().__init__(f"stopped by {signal.Signals(signum).name} at step {step}; last complete checkpoint: {last}")


class StopSignal:
    """Installed for the duration of a run (main thread only; elsewhere it never fires)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def __enter__(self) -> "StopSignal":
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt  # the second signal: stop now, without the checkpoint
        self.signum = signum
        print(f"\n{signal.Signals(signum).name}: stopping after the current step (send it again to stop at once, "
              f"without a checkpoint)", file=sys.stderr, flush=True)
