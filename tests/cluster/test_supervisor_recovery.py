"""The supervisor's recovery order after a stall on a frozen node: wait (bounded) for Ray to declare the node dead,
then for room for the plan, then rebuild; a node that stays silent past the deadline sends the run to the fallback."""
from __future__ import annotations

import pytest

from fleetrl.cluster.placement import PlacementError
from fleetrl.cluster.watchdog import StallError
from fleetrl.config import derive_plan, load_config
from fleetrl.trainer import supervisor

OVERRIDES = ["cluster.pools.main.nodes=2", "data.prompts_per_step=8", "trainer.restart_wait_s=20", "trainer.max_restarts=1",
             "cluster.fallback_pools={main: {cpus_per_worker: 0.5}}"]


class _Tracker:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    def event(self, step: int, name: str, **fields) -> None:
        self.events.append((name, fields))


def _fake_trainer(outcomes: list, built: list):
    class Trainer:
        def __init__(self, plan, *args, **kwargs) -> None:
            self.plan, self.step = plan, 2
            built.append(plan)

        def fit(self) -> dict:
            outcome = outcomes.pop(0)
            if isinstance(outcome, Exception):
                raise outcome
            return outcome

        def shutdown(self) -> None:
            pass

    return Trainer


def test_a_stall_on_a_frozen_node_waits_for_its_death_before_rebuilding(monkeypatch, tmp_path):
    plan = derive_plan(load_config("examples/quickstart.yaml", OVERRIDES))
    order, built = [], []
    stall = StallError("pool 'main' rank 1 (node 10.0.0.2, pid 7) made no progress", {"nb": "10.0.0.2"})
    monkeypatch.setattr(supervisor, "Trainer", _fake_trainer([stall, {"done": 1.0}], built))
    monkeypatch.setattr(supervisor, "wait_until_declared",
                        lambda nodes, timeout_s: order.append(("declared", dict(nodes), timeout_s)) or 3.0)
    monkeypatch.setattr(supervisor, "wait_for_capacity", lambda p, timeout_s: order.append(("capacity", timeout_s)))
    tracker = _Tracker()
    assert supervisor.Supervisor(plan, tracker, tmp_path).run() == {"done": 1.0}
    assert [o[0] for o in order] == ["declared", "capacity"] and order[0][1:] == ({"nb": "10.0.0.2"}, 20.0)
    assert order[1][1] <= 20.0  # one restart_wait_s for both waits
    assert ("unresponsive_nodes", {"nodes": ["10.0.0.2"], "waited_s": 3.0}) in tracker.events
    assert built == [plan, plan]  # the original plan again: Ray declared the node dead, and the plan fits


def test_a_node_silent_past_the_deadline_sends_the_run_to_the_fallback(monkeypatch, tmp_path):
    plan = derive_plan(load_config("examples/quickstart.yaml", OVERRIDES))
    built: list = []
    stall = StallError("pool 'main' rank 1 ... made no progress", {"nb": "10.0.0.2"})
    monkeypatch.setattr(supervisor, "Trainer", _fake_trainer([stall, {"done": 1.0}], built))

    def silent(nodes, timeout_s):
        raise PlacementError("after the stall, node(s) 10.0.0.2 did not answer for 20s (trainer.restart_wait_s)")

    monkeypatch.setattr(supervisor, "wait_until_declared", silent)
    monkeypatch.setattr(supervisor, "wait_for_capacity", lambda p, timeout_s: None)
    tracker = _Tracker()
    supervisor.Supervisor(plan, tracker, tmp_path).run()
    assert [name for name, _ in tracker.events] == ["stall", "restart", "fallback_placement"]
    assert built[1] is not plan and built[1].pools["main"].nodes == 1


def test_a_lost_worker_is_not_a_frozen_node(monkeypatch, tmp_path):
    """A worker that died (Ray saw it) names no unresponsive node: nothing to wait for before the capacity check."""
    from fleetrl.cluster.group import WorkerLostError

    plan = derive_plan(load_config("examples/quickstart.yaml", OVERRIDES))
    built, capacity = [], []
    monkeypatch.setattr(supervisor, "Trainer", _fake_trainer([WorkerLostError("pool 'main': a worker died"),
                                                              {"done": 1.0}], built))
    monkeypatch.setattr(supervisor, "wait_until_declared", lambda nodes, timeout_s: pytest.fail("not a frozen node"))
    monkeypatch.setattr(supervisor, "wait_for_capacity", lambda p, timeout_s: capacity.append(timeout_s))
    tracker = _Tracker()
    assert supervisor.Supervisor(plan, tracker, tmp_path).run() == {"done": 1.0}
    assert len(capacity) == 1 and 19.0 < capacity[0] <= 20.0  # straight to the capacity check: restart_wait_s left
    assert [name for name, _ in tracker.events] == ["restart"]
    assert built == [plan, plan]  # the same plan rebuilt: not the fallback
