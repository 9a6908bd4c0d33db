"""rewards.model / rewards.combine / cluster.roles.reward_model: validated once, placed like other roles."""
import pytest

from fleetrl.config import ConfigError, derive_plan, load_config

RM = "rewards.model={path: 'tiny:'}"
POOLS = ["cluster.pools={main: {cpus_per_worker: 1}, rm: {workers_per_node: 2, cpus_per_worker: 0.5}}"]


def plan(*overrides):
    return derive_plan(load_config(None, list(overrides)))


def test_no_model_no_role():
    assert "reward_model" not in plan().roles


def test_model_colocates_with_actor_by_default():
    p = plan(RM)
    assert p.roles["reward_model"] == "main"
    assert "reward_model" in p.pools["main"].roles


def test_own_pool_is_data_parallel_and_in_summary():
    p = plan(RM, *POOLS, "cluster.roles={actor: main, rollout: main, reward_model: rm}")
    assert p.world["reward_model"] == 2 and p.pools["rm"].roles == ("reward_model",)
    summary = p.summary()
    assert summary["roles"]["reward_model"] == "rm (dp=2)"
    assert summary["pools"]["rm"]["bundle"] == {"CPU": 0.5} and summary["pools"]["rm"]["bundles_per_node"] == 2


def test_rm_pool_must_split_the_samples():
    # 32 prompts × 8 = 256 samples; a 3-worker RM pool cannot take equal shares
    with pytest.raises(ConfigError, match="do not split over the 3 data-parallel workers of role 'reward_model'"):
        plan(RM, "cluster.pools={main: {}, rm: {workers_per_node: 3}}",
             "cluster.roles={actor: main, rollout: main, reward_model: rm}", "data.prompts_per_step=32")


def test_role_without_model_is_an_error():
    with pytest.raises(ConfigError, match="cluster.roles.reward_model is set but rewards.model is not"):
        plan("cluster.roles={actor: main, reward_model: main}")


def test_model_weight_without_model_is_an_error():
    with pytest.raises(ConfigError, match=r"rewards.combine gives model weight != 0 for \['default'\]"):
        plan("rewards.combine={default: {rule: 0, model: 1}}")


def test_all_zero_weights_are_an_error():
    with pytest.raises(ConfigError, match="rewards.combine.synthetic/copy: rule and model weights are both 0"):
        plan(RM, "rewards.combine={synthetic/copy: {rule: 0, model: 0}}")


def test_judge_template_needs_both_slots():
    with pytest.raises(ConfigError, match=r"rewards.model.template must contain \{response\}"):
        plan("rewards.model={path: 'tiny:', kind: judge, template: 'Rate {prompt}'}")


@pytest.mark.parametrize("key", ["max_length", "micro_batch_size", "max_new_tokens"])
def test_sizes_must_be_positive(key):
    with pytest.raises(ConfigError, match=f"rewards.model.{key} must be >= 1, got 0"):
        plan(f"rewards.model={{path: 'tiny:', {key}: 0}}")


def test_empty_path_is_an_error():
    with pytest.raises(ConfigError, match="rewards.model.path is empty"):
        plan("rewards.model={path: ' '}")


def test_unknown_kind_names_the_choices():
    with pytest.raises(ConfigError, match=r"rewards.model.kind: unknown value 'classifier'.*scalar, judge"):
        load_config(None, ["rewards.model={path: 'tiny:', kind: classifier}"])


def test_unknown_rm_pool_names_the_pools():
    with pytest.raises(ConfigError, match="cluster.roles.reward_model: unknown pool 'rmpool'"):
        plan(RM, "cluster.roles={actor: main, reward_model: rmpool}")


def test_colocated_with_the_critic():
    p = plan(RM, "algorithm.advantage=gae", "cluster.pools={main: {}, side: {}}",
             "cluster.roles={actor: main, rollout: main, critic: side, reward_model: side}")
    assert p.pools["side"].roles == ("critic", "reward_model") and p.pools["main"].roles == ("actor", "rollout")
