"""World 2 (two Ray workers, gloo) trains on the same mini-batches as world 1 and gets the same per-step losses.

Why this holds: the step's groups are partitioned whole, each mini-batch's groups on their own (batch.py
GroupPartition), so a mini-batch is the same set of samples at any world size; each rank normalises its loss by
the mini-batch's GLOBAL token counts and the gradients are summed across ranks, so the summed gradient is the
full-batch gradient. Greedy decoding (temperature 0) makes the rollouts independent of which rank draws them (a
sampled rollout takes its seed from the rank), and PPO + GAE gives every sample a non-zero advantage from the
critic even when a prompt's samples agree. What may differ is the order of float additions (gloo's sum of two
partial gradients against one sum): far below the 1e-4 relative tolerance here.
"""
from __future__ import annotations

import math

import pytest

from tests.integration.helpers import train_run

pytestmark = pytest.mark.slow
COMMON = ("trainer.total_steps=3", "trainer.val_every=0", "trainer.val_before_train=false",
          "data.prompts_per_step=8", "algorithm.mini_batch_prompts=4", "algorithm.micro_batch_size=8",
          "rollout.n=2", "rollout.temperature=0", "tracking.tensorboard=false")
KEYS = ("train/actor/pg_loss", "train/critic/vf_loss", "train/actor/grad_norm", "train/critic/grad_norm",
        "train/reward_mean", "train/kl")


def _record_partitions(monkeypatch) -> list:
    """(phase, batch, partition) of every group call and update layout the controller makes."""
    from fleetrl.cluster.group import WorkerGroup
    from fleetrl.trainer import trainer

    seen: list = []
    call_groups, arrange = WorkerGroup.call_groups, trainer.arrange_update

    def recording_call(self, method, batch, partition, *args, **kw):
        seen.append((method.__name__, batch, partition))
        return call_groups(self, method, batch, partition, *args, **kw)

    def recording_arrange(batch, partition, *args, **kw):
        seen.append(("update_actor" if "advantages" in batch else "update_critic", batch, partition))
        return arrange(batch, partition, *args, **kw)

    monkeypatch.setattr(WorkerGroup, "call_groups", recording_call)
    monkeypatch.setattr(trainer, "arrange_update", recording_arrange)
    return seen


def _steps(records: list[dict]) -> list[dict]:
    return [{k: r[k] for k in KEYS if k in r} for r in records if "train/actor/pg_loss" in r]


def test_world_two_equals_world_one_rank_local(tmp_path, ray_local):
    """The rank-local step (Plan.rank_local: every role in one pool): world 2 = world 1, and the driver moves no
    per-sample tensor: nothing per-sample comes back from a worker, and what goes out is the step's prompts."""
    one = train_run("examples/ppo_tiny.yaml", tmp_path / "w1", *COMMON, "cluster.backend=local")
    two = train_run("examples/ppo_tiny.yaml", tmp_path / "w2", *COMMON, "cluster.backend=ray",
                    "cluster.pools.main.workers_per_node=2")
    _same_losses(_steps(one), _steps(two))
    driver = train_run("examples/ppo_tiny.yaml", tmp_path / "w2d", *COMMON, "cluster.backend=ray",
                       "cluster.pools.main.workers_per_node=2", "trainer.rank_local=false")
    local_out = [r["train/driver/bytes_out/main"] for r in two if "train/actor/pg_loss" in r]
    driver_out = [r["train/driver/bytes_out/main"] for r in driver if "train/actor/pg_loss" in r]
    assert all(r["train/driver/bytes_in/main"] == 0 for r in two if "train/actor/pg_loss" in r)
    assert all(r["train/driver/bytes_in/main"] > 0 for r in driver if "train/actor/pg_loss" in r)
    # out: 8 prompts once (the driver path sends each prompt n = 2 times, then every sample's tokens, log-probs
    # and advantages again for each later phase)
    assert all(0 < a * 4 < b for a, b in zip(local_out, driver_out)), (local_out, driver_out)
    _same_losses(_steps(one), _steps(driver))


def test_world_two_equals_world_one_through_the_driver(tmp_path, ray_local, monkeypatch):
    """The driver path (roles in different pools take it; forced here with trainer.rank_local=false): one group
    partition per step, shared by every phase, and world 2 = world 1."""
    one = _steps(train_run("examples/ppo_tiny.yaml", tmp_path / "w1", *COMMON, "cluster.backend=local",
                           "trainer.rank_local=false"))
    seen = _record_partitions(monkeypatch)
    two = _steps(train_run("examples/ppo_tiny.yaml", tmp_path / "w2", *COMMON, "cluster.backend=ray",
                           "cluster.pools.main.workers_per_node=2", "trainer.rank_local=false"))
    # Each step's phases used ONE partition (the same object: made at generate, reused), of whole groups.
    for phase, batch, part in seen:
        assert part.world == 2
        for rows in part.rows:
            groups = batch["group"][rows]
            for g in set(groups.tolist()):  # a group's samples all on this rank
                assert int((groups == g).sum()) == int((batch["group"] == g).sum()) == 2, phase
    phases = [p for p, _, _ in seen]
    assert phases.count("generate") == 3 and phases.count("update_actor") == 3, phases
    assert len({id(part) for _, _, part in seen}) == 3, "one partition per step, shared by every phase"
    _same_losses(one, two)


def _same_losses(one: list[dict], two: list[dict]) -> None:
    assert len(one) == len(two) == 3
    assert any(abs(s["train/actor/pg_loss"]) > 1e-4 for s in one), "the losses pin nothing"
    for step, (a, b) in enumerate(zip(one, two), start=1):
        assert set(a) == set(b) and len(a) >= 5, (a, b)
        for k in a:
            assert math.isclose(a[k], b[k], rel_tol=1e-4, abs_tol=1e-6), f"step {step}: {k} {a[k]!r} vs {b[k]!r}"


def test_tensor_parallel_rollout_equals_an_engine_per_rank(tmp_path, ray_local):
    """rollout.tensor_parallel=2 (workers/tp_group.py): the two ranks decode their groups together as one TP engine
    (gloo) and each keeps its own; greedy decoding makes the samples those of an engine per rank, so the losses are
    the same, and each rank's report shows the engine's gather."""
    fast = (*COMMON, "cluster.backend=ray", "cluster.pools.main.workers_per_node=2", "rollout.engine=fast")
    one = train_run("examples/ppo_tiny.yaml", tmp_path / "tp1", *fast)
    two = train_run("examples/ppo_tiny.yaml", tmp_path / "tp2", *fast, "rollout.tensor_parallel=2")
    assert not any("tp_gather" in k for r in one for k in r)
    assert any("tp_gather" in k for r in two for k in r), sorted(two[-1])
    _same_losses(_steps(one), _steps(two))


def test_tensor_parallel_engine_owning_its_slices_of_an_fsdp2_actor(tmp_path, ray_local):
    """An FSDP2 actor colocated with a TP=2 fast engine: rollout.own_weights=auto gives the engine its own copy of
    its slices, filled one layer at a time (engines/fast/owned.py), so the actor is never gathered whole; the losses
    equal the FSDP2 run with an engine per rank (which gathers the whole model for each call)."""
    from fleetrl.config import derive_plan, load_config

    fast = (*COMMON, "cluster.backend=ray", "cluster.pools.main.workers_per_node=2", "rollout.engine=fast",
            "actor.sharding=fsdp2")
    assert derive_plan(load_config("examples/ppo_tiny.yaml", [*fast, "rollout.tensor_parallel=2"])).rollout_owns_weights
    assert not derive_plan(load_config("examples/ppo_tiny.yaml", list(fast))).rollout_owns_weights
    one = train_run("examples/ppo_tiny.yaml", tmp_path / "tp1", *fast)
    two = train_run("examples/ppo_tiny.yaml", tmp_path / "tp2", *fast, "rollout.tensor_parallel=2")
    assert any("generate/unshard" in k for r in one for k in r), sorted(one[-1])
    assert not any("generate/unshard" in k for r in two for k in r), "nothing gathers the whole actor"
    assert any("generate/own_weights" in k for r in two for k in r), sorted(two[-1])
    _same_losses(_steps(one), _steps(two))
