"""Runs `Trainer.fit()` and recovers from lost workers/nodes: tear the groups down, wait (bounded) until the
cluster can hold the plan again, rebuild, resume from the newest complete checkpoint, continue — up to
trainer.max_restarts times. Each restart is an event in metrics.jsonl."""
from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path

from fleetrl.cluster.health import is_recoverable, wait_for_capacity, wait_until_declared
from fleetrl.cluster.placement import PlacementError
from fleetrl.cluster.watchdog import StallError
from fleetrl.config.plan import Plan, fallback_plan
from fleetrl.tracking.tracker import Tracker
from fleetrl.trainer.inputs import RunInputs
from fleetrl.trainer.signals import StopSignal
from fleetrl.trainer.trainer import Trainer

log = logging.getLogger("fleetrl.trainer")


class Supervisor:
    """Owns the current Plan: it is replaced by the fallback plan when the original cannot be placed again."""

    def __init__(self, plan: Plan, tracker: Tracker, out_dir: Path, stop: StopSignal | None = None,
                 inputs: RunInputs | None = None) -> None:
        self.inputs = inputs  # read before Ray started; used by the first attempt (a restart reads afresh)
        self.last_step = 0
        self.plan, self.tracker, self.out_dir = plan, tracker, out_dir
        self.stop = stop
        self.restarts = 0

    def run(self) -> dict[str, float]:
        resume = self.plan.config.trainer.resume
        while True:
            trainer = Trainer(self.plan, self.tracker, self.out_dir, resume=resume, stop=self.stop, inputs=self.inputs)
            self.inputs = None
            try:
                return trainer.fit()
            except Exception as e:  # noqa: BLE001 — classified just below; anything else re-raises
                # After a loss, placement may fail while a replacement node is still joining: that is part
                # of recovering. On the first attempt an unplaceable plan is a config error: fail fast.
                retryable = is_recoverable(e) or (self.restarts > 0 and isinstance(e, PlacementError))
                if retryable and isinstance(e, PlacementError) and self._fall_back(max(self.last_step, trainer.step)):
                    # Ray had not yet declared the lost node dead when this rebuild was placed: the fallback
                    # placement is part of the same recovery, not another restart.
                    log.warning("%s\n-> using cluster.fallback_pools", e)
                    trainer.shutdown()
                    continue
                if not retryable or self.restarts >= self.plan.config.trainer.max_restarts:
                    raise
                self.restarts += 1
                self.last_step = max(self.last_step, trainer.step)  # a rebuild that failed early never resumed
                if isinstance(e, StallError):
                    self.tracker.event(self.last_step, "stall", error=str(e)[:2000])
                self.tracker.event(self.last_step, "restart", attempt=self.restarts,
                                   error=f"{type(e).__name__}: {e}"[:500])
                log.warning("recovering from %s (restart %d/%d)", type(e).__name__, self.restarts,
                            self.plan.config.trainer.max_restarts)
                trainer.shutdown()
                self._wait_or_fall_back(self.last_step, e.unresponsive if isinstance(e, StallError) else {})
                resume = "auto"  # the newest complete checkpoint of this run, or the start when there is none
            finally:
                trainer.shutdown()

    def _wait_or_fall_back(self, step: int, unresponsive: Mapping[str, str]) -> None:
        """Waits, within trainer.restart_wait_s in all, for Ray to declare the nodes the stall found frozen dead (so
        that nothing is placed on them), then for room for the plan; falls back when the plan cannot fit."""
        wait_s = self.plan.config.trainer.restart_wait_s
        deadline = time.monotonic() + wait_s
        try:
            if unresponsive:
                log.warning("waiting up to %gs for Ray to declare unresponsive node(s) %s dead", wait_s,
                            ", ".join(unresponsive.values()))
                waited = wait_until_declared(unresponsive, wait_s)
                self.tracker.event(step, "unresponsive_nodes", nodes=sorted(unresponsive.values()),
                                   waited_s=round(waited, 1))
            wait_for_capacity(self.plan, max(0.0, deadline - time.monotonic()))
        except PlacementError as e:
            if not self._fall_back(step):
                raise
            log.warning("%s\n-> using cluster.fallback_pools", e)

    def _fall_back(self, step: int) -> bool:
        """Switches to cluster.fallback_pools/roles once; False when there is none or it is already in use."""
        fallback = fallback_plan(self.plan)
        if fallback is None:
            return False
        wait_for_capacity(fallback, self.plan.config.trainer.restart_wait_s)
        self.tracker.event(step, "fallback_placement", roles=dict(fallback.roles),
                           pools={n: dict(p.bundle) for n, p in fallback.pools.items()})
        self.plan = fallback
        return True
