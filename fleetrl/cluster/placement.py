"""Placement: check a plan against the cluster BEFORE asking Ray, then create placement groups with a timeout.

A pool of `nodes × bundles_per_node` workers becomes ONE placement group of `nodes` node-bundles (each
holding `bundles_per_node` workers' resources), STRICT_SPREAD across nodes when nodes > 1. That states exactly
"N distinct nodes with k workers each", which per-node groups cannot (two of them may land on one node).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    remove_placement_group,
)

from fleetrl.config.plan import PoolPlan
from fleetrl.errors import UserError

_EPS = 1e-6
_IGNORED = ("memory", "object_store_memory")


class PlacementError(UserError, RuntimeError):
    """The plan does not fit the cluster (or did not become ready in time); the message says what to change."""


@dataclass(frozen=True)
class NodeResources:
    node_id: str
    ip: str
    total: dict[str, float]
    available: dict[str, float]


def cluster_nodes() -> list[NodeResources]:
    avail_by_node = _available_by_node()
    nodes = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        # node:<ip> resources stay: pinning a pool to a host with `resources: {"node:10.0.0.2": 0.01}` works.
        total = {k: float(v) for k, v in n["Resources"].items()}
        nodes.append(NodeResources(n["NodeID"], n["NodeManagerAddress"], total,
                                   avail_by_node.get(n["NodeID"], dict(total))))
    return sorted(nodes, key=lambda x: (x.ip, x.node_id))


def _available_by_node() -> dict[str, dict[str, float]]:
    try:
        per_node = ray._private.state.state._available_resources_per_node()  # noqa: SLF001
        return {nid: {k: float(v) for k, v in res.items()} for nid, res in per_node.items()}
    except Exception:
        return {}


def pinned_to(node_id: str) -> dict:
    """Ray options that pin a task or actor to one node (it runs there or not at all), asking for no CPU."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}


def node_bundle(pool: PoolPlan) -> dict[str, float]:
    return {k: v * pool.bundles_per_node for k, v in pool.bundle.items()}


def check_feasible(pools: list[PoolPlan], nodes: list[NodeResources]) -> None:
    """Greedy first-fit of every pool's node-bundles onto distinct nodes' available resources."""
    free = {n.node_id: dict(n.available) for n in nodes}
    problems = []
    for pool in sorted(pools, key=lambda p: -sum(node_bundle(p).values())):
        need = node_bundle(pool)
        placed = 0
        for n in nodes:
            if placed == pool.nodes:
                break
            if _fits(need, free[n.node_id]):
                _take(need, free[n.node_id])
                placed += 1
        if placed < pool.nodes:
            problems.append(_shortfall(pool, need, placed, nodes, pools))
    if problems:
        raise PlacementError("placement does not fit the cluster:\n  " + "\n  ".join(problems)
                             + "\n" + describe_nodes(nodes))


def _fits(need: dict[str, float], free: dict[str, float]) -> bool:
    return all(free.get(k, 0.0) + _EPS >= v for k, v in need.items() if k not in _IGNORED)


def _take(need: dict[str, float], free: dict[str, float]) -> None:
    for k, v in need.items():
        free[k] = free.get(k, 0.0) - v


_SIZES = "nodes / workers_per_node / gpus_per_worker / cpus_per_worker"
_ADD_NODES = "add nodes with `fleetrl cluster up --address HEAD:PORT`"


def _shortfall(pool: PoolPlan, need: dict[str, float], placed: int, nodes: list[NodeResources],
               pools: list[PoolPlan]) -> str:
    """Why `pool` found no room, most basic reason first: it alone asks more than the cluster has; all pools together
    do (a pool that fits alone may not fit beside the others); other runs hold what the plan needs; only then is the
    per-node shape to blame (the resources exist and are free, but no node holds a node-bundle)."""
    keys = [k for k in need if k not in _IGNORED]
    totals = {k: sum(n.total.get(k, 0.0) for n in nodes) for k in keys}
    free = {k: sum(n.available.get(k, 0.0) for n in nodes) for k in keys}
    asked = {k: need[k] * pool.nodes for k in keys}
    shares = {k: {p.name: node_bundle(p).get(k, 0.0) * p.nodes for p in pools} for k in keys}
    together = {k: sum(shares[k].values()) for k in keys}

    def needs(k: str) -> str:
        users = {name: v for name, v in shares[k].items() if v > 0}
        if len(users) < 2:
            return f"needs {together[k]:g}"
        return f"the pools together need {together[k]:g} ({', '.join(f'{n} {v:g}' for n, v in users.items())})"

    def lower(k: str | None) -> str:
        names = [pool.name] if k is None else [n for n, v in shares[k].items() if v > 0]
        if len(names) == 1:
            return f"lower cluster.pools.{names[0]}.{_SIZES}"
        listed = ", ".join(f"cluster.pools.{n}" for n in names[:-1]) + f" and cluster.pools.{names[-1]}"
        return f"lower {listed} ({_SIZES})"

    head = (f"pool '{pool.name}' (roles {', '.join(pool.roles)}) asks for {pool.nodes} node(s) × "
            f"{pool.bundles_per_node} worker(s) of {_fmt(pool.bundle)}; placed on {placed}.")
    alone = [k for k in keys if asked[k] > totals[k] + _EPS]
    if alone:
        what = "; ".join(f"{k}: needs {asked[k]:g}, cluster has {totals[k]:g}" for k in alone)
        return f"{head} {what}. Fix: {lower(None)}, or {_ADD_NODES}"
    short = [k for k in keys if together[k] > totals[k] + _EPS]
    if short:
        what = "; ".join(f"{k}: {needs(k)}, cluster has {totals[k]:g}" for k in short)
        return f"{head} {what}. Fix: {lower(short[0])}, or {_ADD_NODES}"
    held = [k for k in keys if together[k] > free[k] + _EPS]
    if held:
        what = "; ".join(f"{k}: {needs(k)}, cluster has {totals[k]:g} but only {free[k]:g} free" for k in held)
        return (f"{head} {what} (other runs or Ray jobs hold the rest). Fix: stop what holds them (`ray status` "
                f"shows the demands) or wait for them to finish, {lower(held[0])}, or {_ADD_NODES}")
    return (f"{head} no {pool.nodes - placed} more node(s) can each hold {_fmt(need)} (the cluster has enough in "
            f"total and free, but not in that per-node shape). Fix: {lower(None)}, or {_ADD_NODES}")


def describe_nodes(nodes: list[NodeResources]) -> str:
    lines = ["cluster nodes (available / total):"]
    for n in nodes:
        keys = sorted(k for k in n.total if k not in _IGNORED and not k.startswith("node:"))
        res = ", ".join(f"{k} {n.available.get(k, 0.0):g}/{n.total[k]:g}" for k in keys)
        lines.append(f"    {n.ip} [{n.node_id[:8]}]: {res}")
    return "\n".join(lines)


def _fmt(res: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in res.items()) + "}"


def create_pool_group(pool: PoolPlan, timeout_s: float, poll_s: float = 1.0) -> PlacementGroup:
    """The pool's placement group once Ray placed it; PlacementError after timeout_s, or as soon as the alive nodes
    could not hold the pool even if idle (see `_unplaceable`)."""
    bundles = [node_bundle(pool) for _ in range(pool.nodes)]
    strategy = "STRICT_SPREAD" if pool.nodes > 1 else "STRICT_PACK"
    pg = placement_group(bundles, strategy=strategy, name=f"fleetrl-{pool.name}-{time.time_ns()}")
    deadline = time.monotonic() + timeout_s
    placed = pg.ready()  # once: each call starts a task in the group
    while True:
        ready, _ = ray.wait([placed], timeout=max(0.0, min(poll_s, deadline - time.monotonic())))
        if ready:
            ray.get(placed)
            return pg
        short = _unplaceable(pool)
        if short is not None or time.monotonic() >= deadline:
            remove_placement_group(pg)  # a group left pending holds up every later one: Ray places them in turn
            break
    if short is not None:
        why, detail = short
        raise PlacementError(f"placement group for pool '{pool.name}' ({pool.nodes} node(s) × "
                             f"{_fmt(node_bundle(pool))}, {strategy}) cannot be placed: {why}; not waiting out "
                             f"cluster.placement_timeout_s={timeout_s:g}. Fix: configure cluster.fallback_pools, start "
                             f"a replacement node (`fleetrl cluster up --address HEAD:PORT`), or shrink the pool.\n"
                             f"{detail}")
    raise PlacementError(
        f"placement group for pool '{pool.name}' ({pool.nodes} node(s) × {_fmt(node_bundle(pool))}, "
        f"{strategy}) was not ready after {timeout_s:g}s. Other jobs may hold the resources, or nodes left.\n"
        f"{describe_nodes(cluster_nodes())}\nFix: free resources, shrink the pool, or raise "
        f"cluster.placement_timeout_s")


def _unplaceable(pool: PoolPlan) -> tuple[str, str] | None:
    """(why, check_feasible's detail) when the alive nodes cannot hold the pool even once idle, else None.

    Asked while the group waits because a restart may place the plan while Ray still counts a lost node alive (Ray
    takes about 15 s to declare a killed host dead). Without it the group waited all of cluster.placement_timeout_s
    for a node Ray had already declared dead before the fallback placement could run (issue 41)."""
    try:
        alive, dead = cluster_nodes(), sorted({n["NodeManagerAddress"] for n in ray.nodes() if not n.get("Alive")})
    except Exception:  # noqa: BLE001 — no node table this time: keep waiting, the deadline still holds
        return None
    idle = [NodeResources(n.node_id, n.ip, n.total, dict(n.total)) for n in alive]
    try:
        check_feasible([pool], idle)
        return None
    except PlacementError as e:
        lost = f"Ray reports node(s) {', '.join(dead)} dead, and " if dead else ""
        return f"{lost}the alive nodes cannot hold it even when idle", str(e)
