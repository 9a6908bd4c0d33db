"""trainer.async_weights (docs/async.md, Weights in flight): which path the Plan picks, what it refuses, and, through
real Ray workers, that after a streamed async run each rollout engine holds exactly the weights the actor published
last, whether they came over the bus (received beside the decoding into a staging copy, installed by the engine
loop) or through the object store."""
from __future__ import annotations

import pytest
import torch

from fleetrl.cluster.group import _RayWorker
from fleetrl.config import derive_plan, load_config
from fleetrl.config.load import ConfigError
from fleetrl.tracking.tracker import Tracker
from fleetrl.trainer.trainer import Trainer
from tests.integration.test_async import SHORT, SPLIT

STREAM = ("trainer.mode=async", "trainer.stream_rollouts=true", "rollout.engine=fast",
          "algorithm.rollout_correction.mode=tis")


def _plan(*overrides: str):
    return derive_plan(load_config("examples/quickstart.yaml", [*SPLIT, *overrides]))


def test_auto_takes_the_bus_only_where_the_engine_loop_installs_what_arrives():
    assert _plan(*STREAM).pipeline.weights == "bus"
    assert _plan(*STREAM, "trainer.async_weights=store").pipeline.weights == "store"
    # not streamed: each call installs the exact version it is tagged with, which only the store keeps
    assert _plan("trainer.mode=async").pipeline.weights == "store"
    assert _plan("trainer.mode=async", "trainer.partial_rollouts=true").pipeline.weights == "store"
    assert _plan(*STREAM).summary()["pipeline"]["weights"] == "bus"


def test_the_bus_is_refused_where_it_cannot_run():
    with pytest.raises(ConfigError, match=r"trainer.async_weights=bus cannot run with trainer.stream_rollouts=false.*"
                                          r"set trainer.stream_rollouts=true, or trainer.async_weights=store"):
        _plan("trainer.mode=async", "trainer.async_weights=bus")


def test_the_bus_needs_both_pools_on_one_kind_of_device():
    mixed = ("cluster.pools={train: {gpus_per_worker: 1}, gen: {cpus_per_worker: 0.5}}",
             "cluster.roles={actor: train, rollout: gen}")
    plan = derive_plan(load_config("examples/quickstart.yaml", [*mixed, *STREAM]))
    assert plan.pipeline.weights == "store"  # NCCL on one end, Gloo on the other could never meet
    with pytest.raises(ConfigError, match=r"trainer.async_weights=bus broadcasts .* one of the two pools has GPUs"):
        derive_plan(load_config("examples/quickstart.yaml", [*mixed, *STREAM, "trainer.async_weights=bus"]))


def _states(group, role: str) -> list[dict[str, torch.Tensor]]:
    """Each rank's whole weights (FSDP2 shards gathered: every rank of the group reads at once, a collective)."""
    import ray

    from fleetrl.workers.weight_bus import whole

    def read(worker) -> dict[str, torch.Tensor]:
        part = worker._need(role)
        model = part.model if role == "actor" else part.engine_model()
        return {k: whole(v).detach().clone() for k, v in model.state_dict().items()}

    return ray.get([w.__ray_call__.remote(read) for w in group.workers])


TWO_BY_TWO = ("cluster.pools={train: {cpus_per_worker: 0.25, workers_per_node: 2}, gen: {cpus_per_worker: 0.25, "
              "workers_per_node: 2}}", "actor.sharding=fsdp2")


@pytest.mark.slow  # three short runs through Ray workers (~60 s on 2 cores): the slow tier, not the inner loop
@pytest.mark.parametrize("path, layout", [("bus", ()), ("store", ()), ("bus", TWO_BY_TWO)],
                         ids=["bus", "store", "bus-fsdp2-2x2"])
def test_the_engine_holds_the_last_published_weights(tmp_path, ray_local, path, layout):
    _engines_hold_the_last_published_weights(tmp_path, path, layout)


@pytest.mark.gpu
@pytest.mark.slow
def test_over_nccl_beside_a_graph_decoding_loop(tmp_path, ray_local):
    """The GPU path: NCCL, the receive on its own CUDA stream beside the loop's CUDA graphs (captured thread-local),
    the install's event. One actor GPU, one rollout GPU."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs: one actor, one rollout")
    gpus = ("cluster.pools={train: {gpus_per_worker: 1}, gen: {gpus_per_worker: 1}}",
            "rollout.gpu_memory_fraction=0.2")
    _engines_hold_the_last_published_weights(tmp_path, "bus", gpus)


def _engines_hold_the_last_published_weights(tmp_path, path: str, layout: tuple[str, ...]) -> None:
    cfg = load_config("examples/quickstart.yaml", [*SPLIT, *SHORT, *STREAM, *layout, f"trainer.async_weights={path}",
                                                   "trainer.total_steps=3", "trainer.max_staleness=1",
                                                   "tracking.console=false", "tracking.progress=false",
                                                   f"trainer.output_dir={tmp_path}"])
    plan = derive_plan(cfg)
    assert plan.pipeline.weights == path
    trainer = Trainer(plan, Tracker(tmp_path, cfg.tracking, {}, path), tmp_path)
    try:
        trainer.fit()
        trainer.pipeline.load_engines()  # the loop installs what arrived once a call (here the load) reaches it
        actor = _states(trainer.group("actor"), "actor")[0]
        engines = _states(trainer.group("rollout"), "rollout")
        versions = trainer.group("rollout").call_all(_RayWorker.weights_version)
        stats = trainer.group("rollout").call_all(_RayWorker.stream_stats)
    finally:
        trainer.shutdown()
        trainer.tracker.close()
    # step s publishes version s: the last step's update is what every engine holds, bit for bit
    assert versions == [trainer.pipeline.version] * len(engines) and trainer.pipeline.version == 3
    assert all(s["installs"] >= 3 for s in stats), stats  # versions 1..3, each installed by the engine loop
    for rank, engine in enumerate(engines):
        assert engine.keys() == actor.keys()
        moved = [k for k in actor if not torch.equal(engine[k], actor[k])]
        assert not moved, f"{path}: rollout rank {rank}'s {moved[:3]} differ from the actor's published weights"
