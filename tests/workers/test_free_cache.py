"""rollout.free_cache (workers/rollout.py frees_cache): which colocated engines free their KV cache after a call."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fleetrl.config import derive_plan, load_config
from fleetrl.workers import rollout
from fleetrl.workers.context import WorkerContext

GIB = 2**30


def ctx(*overrides: str) -> WorkerContext:
    plan = derive_plan(load_config("examples/quickstart.yaml", ["rollout.engine=fast", *overrides]))
    return WorkerContext(plan=plan, pool="main", roles=("actor", "rollout"), rank=0, world_size=1)


def engine(cache_gib: float) -> SimpleNamespace:
    return SimpleNamespace(cache_bytes=lambda: int(cache_gib * GIB))


@pytest.fixture
def on_a_140_gib_gpu(monkeypatch):
    monkeypatch.setattr(WorkerContext, "device", lambda self: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=140 * GIB))


def test_auto_frees_on_a_cpu_whatever_the_size():
    assert rollout.frees_cache(ctx(), engine(0.001))


def test_auto_on_a_gpu_frees_only_a_cache_over_a_quarter_of_the_card(on_a_140_gib_gpu):
    assert rollout.frees_cache(ctx(), engine(75))        # the Qwen3-8B colocated cache that ran the update out of memory
    assert not rollout.frees_cache(ctx(), engine(34))    # 34 < 35 GiB: kept, and its CUDA graphs with it


def test_auto_frees_an_engine_that_owns_its_weights(on_a_140_gib_gpu):
    """Its copy is refilled at every step anyway; 72B at TP 4 holds ~40 GB of it beside a small cache."""
    owning = ctx("rollout.own_weights=true", "cluster.pools.main.gpus_per_worker=1")
    assert owning.plan.rollout_owns_weights and rollout.frees_cache(owning, engine(1))
    assert not rollout.frees_cache(ctx("rollout.own_weights=true", "rollout.free_cache=false"), engine(1))


def test_true_and_false_override_auto(on_a_140_gib_gpu):
    assert rollout.frees_cache(ctx("rollout.free_cache=true"), engine(1))
    assert not rollout.frees_cache(ctx("rollout.free_cache=false"), engine(75))


def test_only_a_colocated_fast_engine_frees():
    assert not rollout.frees_cache(ctx("rollout.engine=hf"), engine(75))
    separate = ctx("cluster.backend=ray", "cluster.pools={train: {}, gen: {}}", "cluster.roles={actor: train, rollout: gen}")
    assert not separate.plan.rollout_colocated and not rollout.frees_cache(separate, engine(75))


def test_the_cache_budget_is_the_fraction_of_the_workers_gpu(on_a_140_gib_gpu):
    gpu = ["cluster.pools.main.gpus_per_worker=1"]
    assert rollout.cache_budget(ctx(*gpu)) is None  # no key: a slot for every sample
    assert rollout.cache_budget(ctx(*gpu, "rollout.gpu_memory_fraction=0.25")) == 35 * GIB
    assert rollout.cache_budget(ctx(*gpu, "rollout.gpu_memory_fraction=0.5"), total_bytes=80 * GIB) == 40 * GIB
