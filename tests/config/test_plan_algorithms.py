"""Decisions the Plan makes once for the algorithm pieces of issue 13."""
import pytest

from fleetrl.config import ConfigError, derive_plan, load_config


def _plan(*overrides):
    return derive_plan(load_config("examples/quickstart.yaml", list(overrides)))


def test_kl_in_reward_with_an_outcome_estimator_is_folded_into_the_score():
    assert _plan("algorithm.kl.placement=reward").kl_into_score  # grpo ignores token rewards
    assert not _plan("algorithm.kl.placement=reward", "algorithm.advantage=gae").kl_into_score
    assert not _plan("algorithm.kl.placement=loss").kl_into_score


def test_rollout_correction_on_policy_is_computed_in_the_loss():
    assert not _plan().recompute_logprobs  # quickstart: one mini-batch, one epoch
    plan = _plan("algorithm.rollout_correction.mode=tis")
    assert plan.rollout_correction and plan.correction_in_loss and not plan.recompute_logprobs
    plan = _plan("algorithm.rollout_correction.mode=tis", "algorithm.recompute_logprobs=always")
    assert plan.rollout_correction and plan.recompute_logprobs and not plan.correction_in_loss


@pytest.mark.parametrize("override,message", [
    ("algorithm.overlong.buffer=5", "algorithm.overlong.buffer=5 must be between 0 .off. and rollout.max_new_tokens=4"),
    ("algorithm.dynamic_sampling.max_rounds=0", "max_rounds must be >= 1"),
    ("algorithm.rollout_correction.mode=tis algorithm.rollout_correction.cap=0", "cap must be > 0"),
])
def test_bad_algorithm_settings_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        _plan(*override.split())


def test_dual_clip_with_a_loss_that_ignores_it_is_rejected():
    with pytest.raises(ConfigError, match="dual_clip has no effect with policy_loss=cispo"):
        _plan("algorithm.policy_loss=cispo", "algorithm.dual_clip=3")
