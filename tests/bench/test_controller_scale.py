"""bench/controller_scale.py: the real controller against simulated ranks (bench/RESULTS.md's controller-scale
figures rest on it), and the group's actor factory it plugs in through (cluster/group.py ActorFactory)."""
from __future__ import annotations

import pytest
import torch

from bench.controller_scale import PROMPTS_PER_RANK, SimRank, SimulatedRanks, run_one
from fleetrl.batch import Batch
from fleetrl.cluster import group as group_mod
from fleetrl.cluster.group import WorkerGroup
from fleetrl.config import derive_plan, load_config
from fleetrl.workers.context import WorkerContext
from fleetrl.workers.messages import GenerateRequest, PrepareRequest

REQ = GenerateRequest(purpose="generate", step=0, temperature=1.0, min_weights_version=0)


def _plan(world: int = 2):
    return derive_plan(load_config("bench/e2e_grpo.yaml", [
        "cluster.backend=ray", f"cluster.pools.main.workers_per_node={world}", "cluster.pools.main.gpus_per_worker=0",
        "cluster.pools.main.cpus_per_worker=0.01", f"data.prompts_per_step={PROMPTS_PER_RANK * world}"]))


def _prompts(groups: int, length: int = 130) -> Batch:
    return Batch({"prompts": torch.ones(groups, length, dtype=torch.long),
                  "prompt_mask": torch.ones(groups, length, dtype=torch.long), "group": torch.arange(groups)},
                 {"data_source": ["synthetic/lorem"] * groups})


def test_a_simulated_rank_reports_its_own_share_at_full_length():
    plan = _plan()
    rank = SimRank(WorkerContext(plan=plan, pool="main", roles=("actor", "rollout"), rank=1, world_size=2))
    report = rank.rollout_local(_prompts(32), REQ)
    # 32 groups x 8 samples x 256 tokens, 130-token prompts
    assert report.moments["response_length"].n == 256 and report.moments["response_length"].mean == 256
    assert report.tokens == 256 * 256 + 256 * 130
    assert report.moments["prompt_length"].mean == 130 and "reward/synthetic/lorem" in report.moments
    prep = rank.prepare_local(PrepareRequest(kl_coef=0.0))
    assert prep.action_tokens == 256 * 256 and prep.mini_tokens == {"response_mask": (256.0 * 256,)}
    assert rank.update_actor_local(None).shares["actor/tokens_real"] == 256 * 256
    # the driver path: the tensors a real rank returns, per sample: ids and mask (int64), log-probs (float32)
    out = rank.generate(_prompts(256), REQ)
    assert out["responses"].shape == (256, 256) and out["rollout_logprobs"].dtype == torch.float32
    assert list(out["finish_reason"]) == ["length"] * 256


def test_the_group_makes_each_rank_through_its_actor_factory_in_rank_order(monkeypatch):
    """No Ray: _spawn with the placement group stubbed; the factory gets each rank's context and the group's
    options, and SimulatedRanks puts `per_process` ranks in one host, one handle per rank."""
    made = []

    class Remote:  # stands in for ray.remote(SimHost)
        def options(self, **opts):
            return self

        def remote(self, ctx, ranks):
            made.append(ranks)
            return f"host{len(made)}"

    monkeypatch.setattr(group_mod, "create_pool_group", lambda pool, timeout: None)
    monkeypatch.setattr(group_mod, "PlacementGroupSchedulingStrategy", lambda **kw: kw)
    monkeypatch.setattr("ray.remote", lambda cls, **kw: Remote())
    plan = _plan(world=5)
    group = object.__new__(WorkerGroup)  # __init__ would call the workers at once
    group.plan, group.pool, group.world_size, group.serial = plan, plan.pools["main"], 5, False
    seen = []

    def factory(ctx, options):
        seen.append((ctx.rank, options["num_cpus"], options["max_concurrency"]))
        return sim(ctx, options)

    sim = SimulatedRanks(per_process=2)
    group.make_actor = factory
    handles = group._spawn({})
    assert seen == [(r, 0.01, 2) for r in range(5)]
    assert made == [[0, 1], [2, 3], [4]]
    assert [(h.host, h.rank) for h in handles] == [("host1", 0), ("host1", 1), ("host2", 2), ("host2", 3),
                                                   ("host3", 4)]


@pytest.mark.slow  # starts Ray and two hosts of simulated ranks (~1 min on 2 cores)
@pytest.mark.parametrize("rank_local", [True, False], ids=["rank_local", "driver_path"])
def test_the_real_controller_runs_two_steps_on_two_simulated_ranks(tmp_path, rank_local):
    rows = run_one(2, rank_local, per_process=2 if rank_local else 1, steps=2, out_dir=tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    last = rows[-1]
    assert last["train/response_length_mean"] == 256
    # one call per rank: the per-rank telemetry has both ranks
    verb = "rollout_local" if rank_local else "generate"
    assert f"train/time/rank/main/{verb}/max_rank" in last
    if rank_local:  # only the prompts leave the driver; nothing per-sample comes back
        assert last["train/driver/bytes_in/main"] == 0 and 0 < last["train/driver/bytes_out/main"] < 1e6
    else:  # 512 samples x 256 tokens: ids + mask (int64) + log-probs (float32) back, at least
        assert last["train/driver/bytes_in/main"] > 512 * 256 * 20
    assert last["bench/driver_rss_mib"] > 0
