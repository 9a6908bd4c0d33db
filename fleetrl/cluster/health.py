"""Failure classification and the bounded waits after a loss: for Ray to declare frozen nodes dead, then for
capacity."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import ray

from fleetrl.cluster.group import WorkerLostError
from fleetrl.cluster.placement import NodeResources, PlacementError, check_feasible, cluster_nodes, pinned_to
from fleetrl.cluster.watchdog import StallError
from fleetrl.cluster.weight_sync import WeightSyncError
from fleetrl.config.plan import Plan, PoolPlan, fallback_plan
from fleetrl.engines.sync_check import SyncCheckError
from fleetrl.rewards.remote import RewardServerLostError

log = logging.getLogger("fleetrl.cluster")

# A reward server that stopped answering is a lost worker too: the restart's start-up health check either
# finds it back or stops the run with a clear message (RemoteRewardError, not recoverable).
_RECOVERABLE = (WorkerLostError, WeightSyncError, StallError, RewardServerLostError, ray.exceptions.RayActorError,
                ray.exceptions.NodeDiedError, ray.exceptions.WorkerCrashedError, ray.exceptions.ObjectLostError)

Decision = Literal["ready", "wait", "short"]
NodeState = Literal["dead", "answering", "silent"]


def is_recoverable(exc: BaseException) -> bool:
    """Lost processes, nodes, placement or a collective broken by a dead peer; not bugs or bad input."""
    if isinstance(exc, _RECOVERABLE):
        return True
    if isinstance(exc, SyncCheckError):  # rollout.sync_check.on_mismatch=restart: resume from the last checkpoint
        return exc.restart
    if isinstance(exc, ray.exceptions.RayTaskError):
        text = str(exc)
        # A surviving rank's collective fails when its peer died (gloo: connection reset / closed; NCCL: abort).
        return any(s in text for s in ("Connection reset", "Connection closed", "connection closed", "Broken pipe",
                                       "NCCL", "Timed out", "ProcessGroup", "died"))
    return False


@dataclass(frozen=True)
class ClusterView:
    """What the wait decides on: alive nodes, nodes Ray reports dead (by IP), nodes being launched."""

    alive: list[NodeResources]
    dead: list[str] = field(default_factory=list)
    pending: int = 0


def observe_cluster() -> ClusterView:
    dead = sorted({n["NodeManagerAddress"] for n in ray.nodes() if not n.get("Alive")})
    return ClusterView(cluster_nodes(), dead, _pending_nodes())


def _pending_nodes() -> int:
    """Nodes an autoscaler is launching (0 when there is no autoscaler, as with `fleetrl cluster up`)."""
    try:
        from ray.autoscaler.v2.sdk import get_cluster_status

        status = get_cluster_status(ray.get_runtime_context().gcs_address, timeout=2)
        return len(status.pending_nodes) + len(status.pending_launches)
    except Exception:  # noqa: BLE001 — no autoscaler (v2) status: nothing is known to be on its way
        return 0


def capacity_decision(pools: list[PoolPlan], view: ClusterView, wait_for_new_nodes: bool) -> Decision:
    """ready: the plan fits now. wait: it may fit soon (resources being released, or nodes may join).
    short: even idle, the alive nodes cannot hold it and no node is on its way, so waiting cannot help."""
    try:
        check_feasible(pools, view.alive)
        return "ready"
    except PlacementError:
        pass
    if wait_for_new_nodes or view.pending:
        return "wait"
    # Torn-down placement groups free their resources a moment later: judge by totals, not by what is free now.
    idle = [replace(n, available=dict(n.total)) for n in view.alive]
    try:
        check_feasible(pools, idle)
        return "wait"
    except PlacementError:
        return "short"


def wait_for_capacity(plan: Plan, timeout_s: float, poll_s: float = 2.0, *, wait_for_new_nodes: bool | None = None,
                      observe: Callable[[], ClusterView] = observe_cluster) -> None:
    """Returns once the cluster can hold `plan`; PlacementError after timeout_s, or at once when it is short.

    `wait_for_new_nodes` (default: only when the plan has no cluster.fallback_pools) keeps waiting while the alive
    nodes are too few, for a replacement started by hand. With a fallback there is something better to do than
    wait for a node Ray already reports dead, so a short cluster fails fast and the fallback runs on this restart.
    """
    if wait_for_new_nodes is None:
        wait_for_new_nodes = fallback_plan(plan) is None
    pools = list(plan.pools.values())
    deadline = time.monotonic() + timeout_s
    while True:
        view = observe()
        decision = capacity_decision(pools, view, wait_for_new_nodes)
        if decision == "ready":
            return
        if decision == "short" or time.monotonic() > deadline:
            raise PlacementError(_wait_message(pools, view, decision, timeout_s))
        time.sleep(poll_s)


def _wait_message(pools: list[PoolPlan], view: ClusterView, decision: Decision, timeout_s: float) -> str:
    try:
        check_feasible(pools, view.alive)
        detail = ""
    except PlacementError as e:
        detail = str(e)
    dead = f" (Ray reports node(s) {', '.join(view.dead)} dead)" if view.dead else ""
    if decision == "short":
        return (f"after a failure the alive nodes cannot hold the plan even when idle{dead}, and no node is being "
                f"launched; not waiting trainer.restart_wait_s for it:\n{detail}")
    return (f"after a failure the cluster did not regain room for the plan within {timeout_s:g}s "
            f"(trainer.restart_wait_s){dead}:\n{detail}")


def wait_until_declared(nodes: Mapping[str, str], timeout_s: float, poll_s: float = 1.0, *,
                        observe: Callable[[Mapping[str, str]], dict[str, NodeState]] | None = None) -> float:
    """Returns (seconds waited) once every node of `nodes` (node id -> ip: the nodes a stall's diagnosis could not
    reach) is dead in Ray's view, or answers again; PlacementError naming the silent ones after timeout_s.

    Why: Ray keeps a frozen node alive until its health checks fail (about a minute with Ray's defaults). A placement
    group Ray aims at it meanwhile never gets an answer, and Ray places groups one at a time, so every later group
    waits behind it, the fallback's on healthy nodes included, even once the node is declared dead (docs/hangs.md)."""
    observe = observe or _NodeWatch()
    start = time.monotonic()
    while True:
        states = observe(nodes) if nodes else {}
        silent = [node_id for node_id, state in states.items() if state == "silent"]
        if not silent:
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            raise PlacementError(_silent_message([nodes[n] for n in silent], timeout_s))
        time.sleep(poll_s)


def _silent_message(ips: list[str], timeout_s: float) -> str:
    return (f"after the stall, node(s) {', '.join(ips)} did not answer for {timeout_s:g}s (trainer.restart_wait_s), "
            f"and Ray still reports them alive: its health checks have not failed yet. Nothing is placed while a "
            f"frozen node counts as alive (a placement group aimed at it would wait for it). Fix: end Ray on that "
            f"node (`fleetrl cluster down` there, or power it off) so that Ray declares it dead; raise "
            f"trainer.restart_wait_s; or start the head with RAY_health_check_period_ms / "
            f"RAY_health_check_failure_threshold lower, so that Ray declares frozen nodes dead sooner")


def _here() -> bool:
    return True


class _NodeWatch:
    """Ray's view of each node, plus one outstanding no-op task pinned to each node Ray still reports alive: a node
    that runs it answers again (it was slow, not frozen)."""

    def __init__(self) -> None:
        self.probes: dict[str, Any] = {}

    def __call__(self, nodes: Mapping[str, str]) -> dict[str, NodeState]:
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        states: dict[str, NodeState] = {}
        for node_id in nodes:
            if node_id not in alive:
                states[node_id] = "dead"
                continue
            if node_id not in self.probes:
                self.probes[node_id] = ray.remote(_here).options(**pinned_to(node_id)).remote()
            states[node_id] = "answering" if self._answered(node_id) else "silent"
        return states

    def _answered(self, node_id: str) -> bool:
        ref = self.probes[node_id]
        if not ray.wait([ref], timeout=0)[0]:
            return False
        try:
            return ray.get(ref, timeout=0)  # ready (ray.wait said so): returns or raises at once
        except ray.exceptions.RayError:  # the node went down under the probe: Ray's view decides on the next poll
            del self.probes[node_id]
            return False
