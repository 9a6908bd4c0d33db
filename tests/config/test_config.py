import dataclasses

import pytest

from fleetrl.config import ConfigError, derive_plan, load_config


def _plan(*overrides):
    return derive_plan(load_config(None, list(overrides)))


def test_overrides_are_typed():
    cfg = load_config(None, ["actor.optim.lr=1e-6", "rollout.stop=</s>", "algorithm.dual_clip=3"])
    assert cfg.actor.optim.lr == 1e-6 and isinstance(cfg.actor.optim.lr, float)
    assert cfg.rollout.stop == ("</s>",)
    assert cfg.algorithm.dual_clip == 3.0


def test_unknown_key_did_you_mean():
    with pytest.raises(ConfigError, match=r"unknown config key 'actor.optim.lrr'; did you mean 'actor.optim.lr'"):
        load_config(None, ["actor.optim.lrr=1"])
    with pytest.raises(ConfigError, match="did you mean 'algorithm'"):
        load_config(None, ["algoritm.advantage=gae"])


def test_wrong_type_names_key():
    with pytest.raises(ConfigError, match=r"rollout.n: expected an integer, got str 'eight'"):
        load_config(None, ["rollout.n=eight"])


def test_config_is_frozen():
    cfg = load_config(None)
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field 'n'"):
        cfg.rollout.n = 4  # type: ignore[misc]
    assert cfg.rollout.n == 8


def test_plan_hand_computed():
    # 8 prompts × 4 samples = 32 samples; mini-batch 4 prompts = 16 samples -> 2 mini-batches;
    # 2 actor workers -> 8 samples per rank per mini-batch, micro 4 -> 2 accumulation steps.
    p = _plan("data.prompts_per_step=8", "rollout.n=4", "algorithm.mini_batch_prompts=4",
              "algorithm.micro_batch_size=4", "cluster.pools.main.workers_per_node=2", "algorithm.advantage=gae")
    assert (p.samples_per_step, p.mini_batch_samples, p.num_mini_batches) == (32, 16, 2)
    assert p.world == {"actor": 2, "rollout": 2, "critic": 2}
    assert p.use_critic and not p.use_ref


def test_samples_not_divisible_by_dp():
    with pytest.raises(ConfigError, match=r"data.prompts_per_step=3 prompts \(each a group of rollout.n=1 samples, never "
                                          r"split\) do not divide over the 2 data-parallel workers of role 'actor'"):
        _plan("data.prompts_per_step=3", "rollout.n=1", "algorithm.advantage=gae",
              "cluster.pools.main.workers_per_node=2", "algorithm.micro_batch_size=1")


def test_groups_are_never_split_over_ranks():
    # 2 prompts x 4 samples = 8 samples would split over 4 ranks, but not as whole groups
    with pytest.raises(ConfigError, match=r"prompts_per_step=2 prompts .* do not divide over the 4 data-parallel "
                                          r"workers of role 'actor'; make data.prompts_per_step a multiple of 4"):
        _plan("data.prompts_per_step=2", "rollout.n=4", "cluster.pools.main.workers_per_node=4")
    with pytest.raises(ConfigError, match=r"a mini-batch of 2 prompts \(groups of 4 samples, never split\) does not "
                                          r"divide over 4 'actor' workers"):
        _plan("data.prompts_per_step=8", "rollout.n=4", "algorithm.mini_batch_prompts=2",
              "cluster.pools.main.workers_per_node=4")


def test_mini_batch_not_multiple_of_micro():
    with pytest.raises(ConfigError, match=r"each 'actor' worker gets 32 samples .* not a multiple of "
                                          r"algorithm.micro_batch_size=5"):
        _plan("data.prompts_per_step=4", "rollout.n=8", "algorithm.micro_batch_size=5")


def test_mini_batch_prompts_must_divide():
    with pytest.raises(ConfigError, match="mini_batch_prompts=3 does not divide data.prompts_per_step=8"):
        _plan("data.prompts_per_step=8", "algorithm.mini_batch_prompts=3")


def test_group_estimator_needs_n_ge_2():
    with pytest.raises(ConfigError, match="rollout.n must be >= 2"):
        _plan("rollout.n=1", "algorithm.advantage=rloo")


def test_unknown_names_and_pools():
    with pytest.raises(ConfigError, match="did you mean 'grpo'"):
        _plan("algorithm.advantage=grpoo")
    with pytest.raises(ConfigError, match="unknown pool 'gpu'"):
        _plan("cluster.roles.critic=gpu", "algorithm.advantage=gae")


def test_example_configs_derive():
    import pathlib

    plans = {path.stem: derive_plan(load_config(path)) for path in sorted(pathlib.Path("examples").glob("*.yaml"))}
    for name, p in plans.items():
        c = p.config
        assert p.samples_per_step == c.data.prompts_per_step * c.rollout.n, name
        assert p.total_steps == c.trainer.total_steps, name
    # quickstart: GRPO, 32 prompts × 8 = 256 samples, one mini-batch, no critic or reference.
    q = plans["quickstart"]
    assert (q.samples_per_step, q.num_mini_batches, q.use_critic, q.use_ref) == (256, 1, False, False)
    # ppo_tiny: GAE critic and a KL reference, 16 × 8 = 128 samples; 160 steps × 1 mini-batch × 1 epoch.
    ppo = plans["ppo_tiny"]
    assert (ppo.samples_per_step, ppo.use_critic, ppo.use_ref, ppo.actor_optimizer_steps) == (128, True, True, 160)
