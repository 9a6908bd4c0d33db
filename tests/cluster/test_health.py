"""Recovery decisions: which failures restart, when waiting for capacity cannot help (fail fast to fallback), and the
wait for Ray to declare a frozen node dead before anything is placed again."""
from __future__ import annotations

import itertools
import time

import pytest

from fleetrl.cluster.health import (
    ClusterView,
    capacity_decision,
    is_recoverable,
    wait_for_capacity,
    wait_until_declared,
)
from fleetrl.cluster.placement import NodeResources, PlacementError
from fleetrl.config import derive_plan, load_config
from fleetrl.config.plan import PoolPlan
from fleetrl.rewards.errors import ScorerFailureError
from fleetrl.rewards.remote import RemoteRewardError, RewardServerLostError

TWO_NODES = ["cluster.pools.main.nodes=2", "data.prompts_per_step=8"]
FALLBACK = ["cluster.fallback_pools={main: {cpus_per_worker: 0.5}}"]


def _node(name: str, total: float, free: float | None = None) -> NodeResources:
    return NodeResources(name, f"10.0.0.{name[-1]}", {"CPU": total}, {"CPU": total if free is None else free})


# One worker of 1 CPU on each of 2 nodes.
POOL = PoolPlan(name="main", nodes=2, bundles_per_node=1, bundle={"CPU": 1.0}, roles=("actor",), cpu_threads=1)


def test_reward_server_loss_restarts_but_a_broken_scorer_does_not():
    assert is_recoverable(RewardServerLostError("scoring 4 samples failed after 3 attempts"))
    assert not is_recoverable(RemoteRewardError("http://x refused the batch: HTTP 401"))
    assert not is_recoverable(ScorerFailureError("reward scorer 'f.py:fn' failed on 16 of 16 samples"))


@pytest.mark.parametrize("view,wait_for_new,expected", [
    # both nodes free: fits now
    (ClusterView([_node("n1", 2), _node("n2", 2)]), False, "ready"),
    # n2's CPUs still held by the torn-down placement group (free 0 of 2): fits once released -> wait
    (ClusterView([_node("n1", 2), _node("n2", 2, free=0)]), False, "wait"),
    # n2 lost: one alive node cannot hold 2 node-bundles even idle, nothing launching -> short (fail fast)
    (ClusterView([_node("n1", 2)], dead=["10.0.0.2"]), False, "short"),
    # ... unless an autoscaler is launching a node
    (ClusterView([_node("n1", 2)], dead=["10.0.0.2"], pending=1), False, "wait"),
    # ... or the caller waits for a replacement started by hand (no fallback placement to switch to)
    (ClusterView([_node("n1", 2)], dead=["10.0.0.2"]), True, "wait"),
])
def test_capacity_decision(view, wait_for_new, expected):
    assert capacity_decision([POOL], view, wait_for_new) == expected


def test_with_a_fallback_a_node_reported_dead_fails_fast():
    plan = derive_plan(load_config("examples/quickstart.yaml", TWO_NODES + FALLBACK))
    start = time.monotonic()
    with pytest.raises(PlacementError, match=r"cannot hold the plan even when idle \(Ray reports node\(s\) "
                                             r"10.0.0.2 dead\).*not waiting trainer.restart_wait_s") as err:
        wait_for_capacity(plan, timeout_s=60, observe=lambda: ClusterView([_node("n1", 2)], dead=["10.0.0.2"]))
    assert time.monotonic() - start < 1.0  # not the 60 s timeout: the supervisor falls back on this restart
    assert "pool 'main'" in str(err.value)


def test_without_a_fallback_it_waits_for_a_replacement_until_the_deadline():
    plan = derive_plan(load_config("examples/quickstart.yaml", TWO_NODES))
    start = time.monotonic()
    with pytest.raises(PlacementError, match=r"did not regain room for the plan within 0.3s"):
        wait_for_capacity(plan, timeout_s=0.3, poll_s=0.05, observe=lambda: ClusterView([_node("n1", 2)]))
    assert 0.3 <= time.monotonic() - start < 2.0


def test_returns_once_released_resources_show_up():
    plan = derive_plan(load_config("examples/quickstart.yaml", TWO_NODES + FALLBACK))
    held = ClusterView([_node("n1", 2), _node("n2", 2, free=0)])
    views = itertools.chain([held, held], itertools.repeat(ClusterView([_node("n1", 2), _node("n2", 2)])))
    calls = []
    wait_for_capacity(plan, timeout_s=10, poll_s=0.01, observe=lambda: calls.append(1) or next(views))
    assert len(calls) == 3  # wait, wait, ready


def test_no_unresponsive_node_no_wait():
    assert wait_until_declared({}, timeout_s=60, observe=lambda nodes: pytest.fail("nothing to observe")) < 0.1


def test_waits_for_ray_to_declare_a_frozen_node_dead():
    """The stall's node is frozen and Ray still reports it alive for two polls, then dead: placing only then keeps the
    plan from being aimed at the frozen node."""
    states = iter(["silent", "silent", "dead"])
    seen = []

    def observe(nodes):
        seen.append(dict(nodes))
        return {"b": next(states)}

    waited = wait_until_declared({"b": "10.0.0.2"}, timeout_s=10, poll_s=0.01, observe=observe)
    assert seen == [{"b": "10.0.0.2"}] * 3 and waited < 1.0


def test_a_node_that_answers_again_is_not_waited_for():
    assert wait_until_declared({"b": "10.0.0.2"}, timeout_s=10, observe=lambda nodes: {"b": "answering"}) < 0.1


def test_a_node_alive_and_silent_past_the_deadline_is_named():
    start = time.monotonic()
    with pytest.raises(PlacementError, match=r"node\(s\) 10.0.0.2 did not answer for 0.2s \(trainer.restart_wait_s\), "
                                             r"and Ray still reports them alive.*fleetrl cluster down") as err:
        wait_until_declared({"a": "10.0.0.1", "b": "10.0.0.2"}, timeout_s=0.2, poll_s=0.01,
                            observe=lambda nodes: {"a": "dead", "b": "silent"})
    assert 0.2 <= time.monotonic() - start < 2.0
    assert "10.0.0.1" not in str(err.value)  # the one Ray declared dead is not blamed


@pytest.mark.slow
def test_real_cluster_node_removed_fails_fast_with_fallback():
    # A two-node ray.cluster_utils cluster; the plan needs both nodes. Once the worker node is removed and Ray
    # reports it dead, the wait gives up in seconds instead of waiting the 60 s restart_wait_s.
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        worker = cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        plan = derive_plan(load_config("examples/quickstart.yaml", TWO_NODES + FALLBACK))
        wait_for_capacity(plan, timeout_s=30)  # both nodes alive: returns at once
        cluster.remove_node(worker)
        start = time.monotonic()
        with pytest.raises(PlacementError, match=r"not waiting trainer.restart_wait_s"):
            wait_for_capacity(plan, timeout_s=60, poll_s=0.5)
        assert time.monotonic() - start < 15  # Ray's own death detection for a removed (killed) node included
    finally:
        ray.shutdown()
        cluster.shutdown()
