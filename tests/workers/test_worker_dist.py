"""A worker's process group (workers/worker.py `init_dist`): made for more than one rank, and for one rank when a
hosted role asks for FSDP2, whose sharded code path then runs with one shard instead of silently not at all."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fleetrl.config import derive_plan, load_config
from fleetrl.engines.training import TrainingEngine
from fleetrl.workers.context import WorkerContext
from fleetrl.workers.worker import Worker


def _worker(*overrides: str) -> Worker:
    plan = derive_plan(load_config("examples/ppo_tiny.yaml", list(overrides)))
    return Worker(WorkerContext(plan=plan, pool="main", roles=plan.pools["main"].roles, rank=0, world_size=1))


@pytest.mark.parametrize("overrides, grouped", [
    ((), False),
    (("actor.sharding=fsdp2",), True),
    (("critic.sharding=fsdp2",), True),
])
def test_one_rank_gets_a_group_only_when_a_role_is_sharded(overrides, grouped, caplog):
    worker = _worker(*overrides)
    addr, port = worker.master_address()
    worker.init_dist(addr, port, timeout_s=30)
    try:
        assert dist.is_initialized() == grouped
        if grouped:
            model = torch.nn.Sequential(torch.nn.Linear(2, 2))
            engine = TrainingEngine(model, worker.ctx.cfg.actor.optim, sharded=True)
            assert engine.sharded and hasattr(model[0].weight, "to_local"), "one shard, through FSDP2"
            assert "Set sharding=none for one-GPU speed" in caplog.text  # it costs time, and says so
    finally:
        worker.shutdown()
    assert not dist.is_initialized()


def test_two_local_workers_share_the_one_rank_group_and_its_owner_ends_it():
    # cluster.backend=local keeps every pool's worker in the driver: a sharded actor pool and a sharded critic
    # pool would otherwise both make the process's default group ("initialize the default process group twice").
    first, second = _worker("actor.sharding=fsdp2"), _worker("critic.sharding=fsdp2")
    first.init_dist(*first.master_address(), timeout_s=30)
    try:
        second.init_dist(*second.master_address(), timeout_s=30)
        assert dist.is_initialized() and first.owns_group and not second.owns_group
        second.shutdown()
        assert dist.is_initialized(), "only the worker that made the group ends it"
    finally:
        first.shutdown()
    assert not dist.is_initialized()


def test_a_failed_local_build_leaves_no_process_group(tmp_path):
    from fleetrl.cluster.group import WorkerGroup
    from fleetrl.models.lora import LoraTargetError

    plan = derive_plan(load_config("examples/ppo_tiny.yaml", [
        "cluster.backend=local", "actor.sharding=fsdp2", "actor.lora={rank: 2, targets: [no_such_proj]}"]))
    with pytest.raises(LoraTargetError, match="no_such_proj"):
        WorkerGroup(plan, "main", backend="local", run_dir=tmp_path)
    assert not dist.is_initialized(), "the next trainer in this process must be able to make its group"
