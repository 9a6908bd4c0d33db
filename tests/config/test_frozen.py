"""Nothing can change a setting after the workers were built from it: configs and Plans are frozen all the way
down, and the choice fields are Literal types checked (with their list) by the loader."""
import dataclasses
import pickle

import pytest

from fleetrl.config import ConfigError, derive_plan, load_config
from fleetrl.config.frozen import FrozenDict


@pytest.fixture
def plan():
    return derive_plan(load_config("examples/ppo_tiny.yaml",
                                   ["cluster.env={A: '1'}", "rewards.sources={x: exact_match}"]))


def test_top_level_and_nested_fields_raise_frozen_instance_error(plan):
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.config.trainer.seed = 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.pools["main"].nodes = 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.total_steps = 1


@pytest.mark.parametrize("mapping", ["env", "pools", "roles", "plan_roles", "plan_pools", "bundle", "world", "sources"])
def test_mappings_raise_type_error(plan, mapping):
    target = {"env": plan.config.cluster.env, "pools": plan.config.cluster.pools, "roles": plan.config.cluster.roles,
              "plan_roles": plan.roles, "plan_pools": plan.pools, "bundle": plan.pools["main"].bundle,
              "world": plan.world, "sources": plan.config.rewards.sources}[mapping]
    assert isinstance(target, FrozenDict)
    with pytest.raises(TypeError, match="does not support item assignment"):
        target["x"] = 1
    with pytest.raises(AttributeError, match="update"):
        target.update({"x": 1})


def test_any_typed_values_are_frozen_too():
    cfg = load_config("examples/quickstart.yaml", ["data.train={a: x.jsonl, b: [1, 2]}"])
    assert cfg.data.train == {"a": "x.jsonl", "b": (1, 2)}
    with pytest.raises(TypeError, match="does not support item assignment"):
        cfg.data.train["a"] = "y.jsonl"


def test_frozen_config_and_plan_pickle_to_workers(plan):
    assert pickle.loads(pickle.dumps(plan)) == plan


@pytest.mark.parametrize("key,value,listed", [
    ("rollout.engine", "fsat", "did you mean 'fast'? (choose from: hf, fast, vllm)"),
    ("trainer.on_nonfinite", "ignore", "(choose from: skip, abort)"),
    ("actor.optim.schedule", "cosin", "did you mean 'cosine'?"),
    ("cluster.backend", "slurm", "(choose from: ray, local)"),
])
def test_literal_choices_are_checked_by_the_loader(key, value, listed):
    with pytest.raises(ConfigError, match=f"^{key}: unknown value '{value}'.*") as e:
        load_config("examples/quickstart.yaml", [f"{key}={value}"])
    assert listed in str(e.value)


def test_a_bare_yaml_off_is_the_off_choice():
    # `actor.autocast=off` is YAML 1.1's boolean False before it reaches the Literal field: it means "off"
    cfg = load_config("examples/quickstart.yaml", ["actor.autocast=off"])
    assert cfg.actor.autocast == "off"
    # a boolean where no choice is spelled that way stays an error naming the key
    with pytest.raises(ConfigError, match="^cluster.backend: unknown value False"):
        load_config("examples/quickstart.yaml", ["cluster.backend=off"])
