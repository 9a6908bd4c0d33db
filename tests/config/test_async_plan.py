"""trainer.mode=async: what the Plan derives (config/async_plan.py) and the errors that name the key and the fix."""
from __future__ import annotations

import pytest

from fleetrl.config import derive_plan, load_config
from fleetrl.config.load import ConfigError
from fleetrl.config.plan import Plan

SPLIT = ("cluster.pools={train: {cpus_per_worker: 0.5}, gen: {cpus_per_worker: 0.5, workers_per_node: 2}}",
         "cluster.roles={actor: train, rollout: gen}")


def _plan(*overrides: str) -> Plan:
    return derive_plan(load_config(None, ["algorithm.micro_batch_size=1", "data.prompts_per_step=6", "rollout.n=2",
                                          *overrides]))


def test_sync_has_no_pipeline():
    assert _plan(*SPLIT).pipeline is None


def test_async_numbers():
    p = _plan(*SPLIT, "trainer.mode=async", "trainer.max_staleness=2")
    # 6 prompts over 2 rollout workers: chunks of ceil(6/2) = 3 groups, 2 per step; window (2+1)·6 = 18 groups.
    assert (p.pipeline.chunk_groups, p.pipeline.chunks_per_step, p.pipeline.window_groups) == (3, 2, 18)
    assert p.pipeline.max_chunks_per_step == 2
    # staleness > 0 but one optimiser step (1 mini-batch, 1 epoch): the proximal policy of decoupled PPO is the
    # update's own forward, so nothing is recomputed
    assert not p.recompute_logprobs
    # not streamed: each call installs the version it is tagged with, from the object store
    assert p.summary()["pipeline"] == {"max_staleness": 2, "stale": "hold", "chunk_groups": 3, "window_groups": 18,
                                       "weights": "store"}


@pytest.mark.parametrize("kl, recompute", [
    ("algorithm.kl.placement=loss", False),  # the loss forward is the trained policy: nothing read before it
    ("algorithm.kl.placement=reward", True),  # the reward penalty needs the trained policy before the update
    ("algorithm.kl.placement=loss algorithm.kl.controller=adaptive", True),  # so does the adaptive controller
])
def test_stale_samples_recompute_only_for_a_kl_read_before_the_update(kl, recompute):
    p = _plan(*SPLIT, "trainer.mode=async", "trainer.max_staleness=1", "algorithm.rollout_correction.mode=tis",
              *kl.split())
    assert (p.recompute_logprobs, p.correction_in_loss) == (recompute, not recompute)
    p = _plan(*SPLIT, "trainer.mode=async", "trainer.max_staleness=0", *kl.split())
    assert not p.recompute_logprobs  # nothing stale: the rollout's log-probs are the trained policy's


def test_staleness_zero_keeps_the_synchronous_decisions():
    p = _plan(*SPLIT, "trainer.mode=async", "trainer.max_staleness=0")
    assert not p.recompute_logprobs  # as in sync mode: on-policy, nothing stale
    assert p.pipeline.window_groups == 6


def test_chunks_and_dynamic_sampling_rounds():
    # 6 prompts in chunks of 2 = 3 chunks per step; 4 rounds of dynamic sampling: at most 3·4 = 12 chunks a step.
    p = _plan(*SPLIT, "trainer.mode=async", "trainer.chunk_groups=2", "algorithm.dynamic_sampling.enabled=true",
              "algorithm.dynamic_sampling.max_rounds=4")
    assert p.pipeline.max_chunks_per_step == 12
    # a generate call carries 2 groups × 2 samples = 4; the step's 12 samples / 2 workers = 6 is larger
    assert p.rollout.max_batch == 6


def test_colocated_rollout_names_the_roles_and_the_fix():
    with pytest.raises(ConfigError, match=r"trainer.mode=async .* rollout role needs its own pool; cluster.roles "
                                          r"puts rollout and actor both in pool 'main'.*cluster.roles=\{actor: train, "
                                          r"rollout: gen\}"):
        _plan("trainer.mode=async")


def test_local_backend_is_refused():
    with pytest.raises(ConfigError, match="trainer.mode=async .* Set cluster.backend=ray"):
        _plan(*SPLIT[:1], "cluster.pools.gen.workers_per_node=1", SPLIT[1], "cluster.backend=local",
              "trainer.mode=async")


@pytest.mark.parametrize("override, match", [
    ("trainer.max_staleness=-1", r"trainer.max_staleness must be >= 0 .* got -1"),
    ("trainer.chunk_groups=4", r"trainer.chunk_groups=4 must divide data.prompts_per_step=6 .* one of 1, 2, 3, 6"),
    ("trainer.stale=wait", r"trainer.stale: unknown value 'wait' .*hold, drop"),
])
def test_bad_values_name_the_key(override, match):
    with pytest.raises(ConfigError, match=match):
        _plan(*SPLIT, "trainer.mode=async", override)


def test_streamed_rollouts_size_the_loop_and_refuse_what_they_cannot_stream():
    p = _plan(*SPLIT, "trainer.mode=async", "trainer.max_staleness=2", "trainer.stream_rollouts=true",
              "rollout.engine=fast")
    # the window's 18 groups are 6 chunks of 3, any of which one worker may hold (drop), plus a load and a validation
    assert p.pipeline.stream and p.pipeline.stream_calls == 6 + 2
    assert p.rollout.max_batch == 18 * 2 // 2  # a worker's share of the window's samples
    assert not _plan(*SPLIT, "trainer.mode=async").pipeline.stream
    for overrides, match in [
        (("trainer.stream_rollouts=true", "rollout.engine=fast"), r"only trainer.mode=async publishes"),
        (("trainer.mode=async", "trainer.stream_rollouts=true"), r"rollout.engine=hf has none here"),
        (("trainer.mode=async", "trainer.stream_rollouts=true", "rollout.engine=fast", "trainer.partial_rollouts=true"),
         r"supersedes trainer.partial_rollouts"),
    ]:
        with pytest.raises(ConfigError, match=match):
            _plan(*SPLIT, *overrides)
