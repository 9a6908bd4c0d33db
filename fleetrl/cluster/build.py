"""Turns a Plan into running WorkerGroups: Ray up, feasibility checked, one group per pool."""
from __future__ import annotations

import logging
from pathlib import Path

from fleetrl.cluster.envcheck import resolve_device_env
from fleetrl.cluster.group import ActorFactory, WorkerGroup
from fleetrl.cluster.placement import check_feasible, cluster_nodes
from fleetrl.cluster.runtime import ensure_ray
from fleetrl.config.plan import Plan

log = logging.getLogger("fleetrl.cluster")


def build_groups(plan: Plan, run_dir: Path | None = None,
                 make_actor: ActorFactory | None = None) -> dict[str, WorkerGroup]:
    """`make_actor`: how each rank's Ray actor is made (cluster/group.py ActorFactory); None = fleetrl's Worker."""
    cfg = plan.config.cluster
    if cfg.backend == "local":
        return {name: WorkerGroup(plan, name, backend="local") for name in plan.pools}
    ensure_ray(cfg)
    check_feasible(list(plan.pools.values()), cluster_nodes())
    env = resolve_device_env(cfg.env)
    groups: dict[str, WorkerGroup] = {}
    try:
        for name in plan.pools:
            groups[name] = WorkerGroup(plan, name, backend="ray", env=env, run_dir=run_dir, make_actor=make_actor)
    except BaseException:
        for g in groups.values():
            g.shutdown()
        raise
    return groups
