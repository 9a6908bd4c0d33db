"""A run's heartbeat as the sweep sees it from outside: new lines in its metrics.jsonl.

The trainer writes one line per step (and per event), so "no new line for `stall_s`" is a stall however the
run got stuck (a hung collective, a stuck reward server, a stopped node). The file is read incrementally from
the last offset, so polling a long run costs only its new lines.
"""
from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

TRAIN_REWARD, VAL_REWARD, STEP_TIME = "train/reward_mean", "val/reward_mean", "train/time/step"


@dataclass
class Heartbeat:
    path: Path
    total_steps: int | None
    offset: int = 0
    step: int = 0
    reward: float | None = None
    val_reward: float | None = None
    clock: Callable[[], float] = time.monotonic
    last_line_at: float = -1.0
    _step_times: list[float] = field(default_factory=list)
    _seen: list[tuple[float, int]] = field(default_factory=list)
    """(when, step) each time a poll saw the step advance; the last 10."""

    def __post_init__(self) -> None:
        if self.last_line_at < 0:
            self.last_line_at = self.clock()

    def poll(self) -> bool:
        """Read new complete lines; True when there were any."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return False
        end = chunk.rfind(b"\n")
        if end < 0:
            return False  # a line still being written: wait for its newline
        self.offset += end + 1
        before = self.step
        for line in chunk[:end].splitlines():
            try:
                self._absorb(json.loads(line))
            except (json.JSONDecodeError, TypeError):
                continue  # a torn line from a killed attempt; the report skips it too
        self.last_line_at = self.clock()
        if self.step > before:
            self._seen = (self._seen + [(self.last_line_at, self.step)])[-10:]
        return True

    def _absorb(self, rec: dict) -> None:
        if "event" in rec or not isinstance(rec.get("step"), int):
            return
        self.step = rec["step"]
        if _finite(rec.get(TRAIN_REWARD)):
            self.reward = rec[TRAIN_REWARD]
        if _finite(rec.get(VAL_REWARD)):
            self.val_reward = rec[VAL_REWARD]
        if _finite(rec.get(STEP_TIME)):
            self._step_times = (self._step_times + [rec[STEP_TIME]])[-10:]

    def silent_for(self) -> float:
        return self.clock() - self.last_line_at

    @property
    def s_per_step(self) -> float | None:
        """Wall-clock seconds per step over the recent steps seen (validation and checkpoints included, which
        is what an ETA needs); until 2 s of that is seen, the trainer's own train/time/step."""
        if len(self._seen) >= 2 and self._seen[-1][0] - self._seen[0][0] >= 2.0:
            (t0, s0), (t1, s1) = self._seen[0], self._seen[-1]
            return (t1 - t0) / (s1 - s0)
        return sum(self._step_times) / len(self._step_times) if self._step_times else None

    @property
    def eta_s(self) -> float | None:
        if self.total_steps is None or self.s_per_step is None:
            return None
        return max(0, self.total_steps - self.step) * self.s_per_step


def _finite(v: object) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)
