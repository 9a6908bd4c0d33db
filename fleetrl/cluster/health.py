"""Failure classification and the bounded wait for capacity after a loss."""
from __future__ import annotations

import time

import ray

from fleetrl.cluster.group import WorkerLostError
from fleetrl.cluster.placement import PlacementError, check_feasible, cluster_nodes
from fleetrl.cluster.watchdog import StallError
from fleetrl.cluster.weight_sync import WeightSyncError
from fleetrl.config.plan import Plan

_RECOVERABLE = (WorkerLostError, WeightSyncError, StallError, ray.exceptions.RayActorError, ray.exceptions.NodeDiedError,
                ray.exceptions.WorkerCrashedError, ray.exceptions.ObjectLostError)


def is_recoverable(exc: BaseException) -> bool:
    """Lost processes, nodes, placement or a collective broken by a dead peer; not bugs or bad input."""
    if isinstance(exc, _RECOVERABLE):
        return True
    if isinstance(exc, ray.exceptions.RayTaskError):
        text = str(exc)
        # A surviving rank's collective fails when its peer died (gloo: connection reset / closed; NCCL: abort).
        return any(s in text for s in ("Connection reset", "Connection closed", "connection closed", "Broken pipe",
                                       "NCCL", "Timed out", "ProcessGroup", "died"))
    return False


def wait_for_capacity(plan: Plan, timeout_s: float, poll_s: float = 2.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            check_feasible(list(plan.pools.values()), cluster_nodes())
            return
        except PlacementError as e:
            if time.monotonic() > deadline:
                raise PlacementError(f"after a failure the cluster did not regain room for the plan within "
                                     f"{timeout_s:g}s (trainer.restart_wait_s):\n{e}") from None
        time.sleep(poll_s)
