"""Runs `Trainer.fit()` and recovers from lost workers/nodes: tear the groups down, wait (bounded) until the
cluster can hold the plan again, rebuild, resume from the newest complete checkpoint, continue — up to
trainer.max_restarts times. Each restart is an event in metrics.jsonl."""
from __future__ import annotations

import logging
from pathlib import Path

from fleetrl.cluster.health import is_recoverable, wait_for_capacity
from fleetrl.cluster.placement import PlacementError
from fleetrl.config.plan import Plan
from fleetrl.tracking.tracker import Tracker
from fleetrl.trainer.trainer import Trainer

log = logging.getLogger("fleetrl.trainer")


class Supervisor:
    def __init__(self, plan: Plan, tracker: Tracker, out_dir: Path) -> None:
        self.plan, self.tracker, self.out_dir = plan, tracker, out_dir
        self.restarts = 0

    def run(self) -> dict[str, float]:
        resume = self.plan.config.trainer.resume
        while True:
            trainer = Trainer(self.plan, self.tracker, self.out_dir, resume=resume)
            try:
                return trainer.fit()
            except Exception as e:  # noqa: BLE001 — classified just below; anything else re-raises
                # After a loss, placement may fail while a replacement node is still joining: that is part
                # of recovering. On the first attempt an unplaceable plan is a config error: fail fast.
                retryable = is_recoverable(e) or (self.restarts > 0 and isinstance(e, PlacementError))
                if not retryable or self.restarts >= self.plan.config.trainer.max_restarts:
                    raise
                self.restarts += 1
                self.tracker.event(trainer.step, "restart", attempt=self.restarts, error=f"{type(e).__name__}: {e}"[:500])
                log.warning("recovering from %s (restart %d/%d)", type(e).__name__, self.restarts,
                            self.plan.config.trainer.max_restarts)
                trainer.shutdown()
                wait_for_capacity(self.plan, self.plan.config.trainer.restart_wait_s)
                resume = "auto"  # the newest complete checkpoint of this run, or the start when there is none
            finally:
                trainer.shutdown()
