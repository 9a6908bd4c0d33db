"""Runs `Trainer.fit()`; on a lost worker/node it tears down, waits for resources, resumes from the last
checkpoint and continues, up to trainer.max_restarts (each restart is an event in metrics.jsonl)."""
from __future__ import annotations

import logging
from pathlib import Path

from fleetrl.config.plan import Plan
from fleetrl.tracking.tracker import Tracker
from fleetrl.trainer.trainer import Trainer

log = logging.getLogger("fleetrl.trainer")


class Supervisor:
    def __init__(self, plan: Plan, tracker: Tracker, out_dir: Path) -> None:
        self.plan, self.tracker, self.out_dir = plan, tracker, out_dir

    def run(self) -> dict[str, float]:
        trainer = Trainer(self.plan, self.tracker, self.out_dir)
        try:
            return trainer.fit()
        finally:
            trainer.shutdown()
