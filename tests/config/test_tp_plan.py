"""rollout.tensor_parallel in the Plan (config/rollout_checks.py `check_tensor_parallel`, config/tensor_parallel.py):
the engine, the rollout world and the model's shape must divide by it, each refusal one line naming the numbers; then any k > 1 is
planned with each engine sized for its k workers' samples; the modes whose calls do not keep an engine's ranks in step
(async, multi-turn) are refused."""
from __future__ import annotations

import pytest

from fleetrl.config import derive_plan, load_config
from fleetrl.config.load import ConfigError
from fleetrl.config.tensor_parallel import folder_shape, tp_degrees, tp_shape_problem
from fleetrl.models.shapes import known_shape

TWO_WORKERS = ["cluster.backend=ray", "cluster.pools.main.workers_per_node=2", "rollout.engine=fast"]


def plan(*overrides: str):
    return derive_plan(load_config("examples/quickstart.yaml", list(overrides)))


def refused(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        plan(*overrides)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_one_is_the_default_and_plans_as_before():
    assert plan().config.rollout.tensor_parallel == 1
    assert plan(*TWO_WORKERS, "rollout.tensor_parallel=1").world["rollout"] == 2


def test_below_one_is_a_range_error():
    assert "rollout.tensor_parallel must be >= 1" in refused("rollout.tensor_parallel=0")


def test_another_engine_is_refused():
    msg = refused("rollout.tensor_parallel=2", "cluster.backend=ray", "cluster.pools.main.workers_per_node=2")
    assert "rollout.engine=hf" in msg and "rollout.engine=fast" in msg


def test_the_rollout_world_must_divide():
    msg = refused("rollout.engine=fast", "rollout.tensor_parallel=2")
    assert "does not divide the 1 rollout workers" in msg


def test_the_models_heads_must_divide(tmp_path):
    # The Plan reads a local folder's config.json (the config layer loads no model; random: and tiny: shapes are
    # checked by the engine, engines/fast/tp.py, and by known_shape below).
    (tmp_path / "config.json").write_text('{"num_attention_heads": 14, "num_key_value_heads": 2, '
                                          '"intermediate_size": 4864}')
    msg = refused(*TWO_WORKERS, "rollout.tensor_parallel=4", "cluster.pools.main.workers_per_node=4",
                  f"model.path={tmp_path}", "model.tokenizer=qwen:")
    assert "num_heads=14 and num_kv_heads=2 not divisible by the tensor-parallel degree 4" in msg
    assert msg.endswith("degrees that divide this model: 1, 2")


def test_a_valid_degree_plans_one_engine_per_k_workers():
    one, two = plan(*TWO_WORKERS), plan(*TWO_WORKERS, "rollout.tensor_parallel=2")
    assert two.world["rollout"] == 2
    assert two.rollout.max_batch == 2 * one.rollout.max_batch  # one engine decodes both workers' samples


def test_async_and_multi_turn_are_refused():
    split = ["cluster.backend=ray", "rollout.engine=fast", "trainer.mode=async",
             "cluster.pools={train: {workers_per_node: 1}, gen: {workers_per_node: 2}}",
             "cluster.roles={actor: train, rollout: gen}"]
    assert plan(*split).world["rollout"] == 2
    msg = refused(*split, "rollout.tensor_parallel=2")
    assert "trainer.mode=async" in msg and "rollout.tensor_parallel=1" in msg


def test_a_checkpoint_folders_shape_is_read_from_its_config(tmp_path):
    (tmp_path / "config.json").write_text('{"num_attention_heads": 12, "num_key_value_heads": 2, '
                                          '"intermediate_size": 8960, "model_type": "qwen2"}')
    assert known_shape(str(tmp_path)) == folder_shape(str(tmp_path)) == (12, 2, 8960)
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    assert known_shape(str(tmp_path)) is None


def test_shapes_and_degrees():
    assert known_shape("random:qwen2.5-7b") == (28, 4, 18944)
    assert known_shape("random:qwen3-8b") == (32, 8, 12288)
    assert known_shape("tiny:") == (4, 4, 128)
    assert known_shape("tiny:heads=8,intermediate=96") == (8, 8, 96)
    assert known_shape("tiny:bogus") is None and known_shape("/some/checkpoint") is None
    assert tp_degrees(28, 4, 18944) == [1, 2, 4]
    assert tp_shape_problem(2, 28, 4, 18944) is None
    assert "intermediate_size=100" in tp_shape_problem(8, 32, 8, 100)


def _folder(tmp_path, model_type: str):
    (tmp_path / "config.json").write_text('{"model_type": "%s", "num_attention_heads": 8, "num_key_value_heads": 2, '
                                          '"intermediate_size": 256}' % model_type)
    return f"model.path={tmp_path}"


def test_a_family_the_fast_paths_do_not_run_is_refused_by_the_plan(tmp_path):
    """A local folder's model_type (config.json, read without loading) is checked before any worker starts; the
    message names the alternatives and their measured cost (config/families.py)."""
    msg = refused(_folder(tmp_path, "gemma3"), "model.tokenizer=qwen:", "rollout.engine=fast")
    assert "rollout.engine=fast" in msg and "'gemma3'" in msg and "rollout.engine=vllm" in msg and "14.8x" in msg
    # what Gemma 3 needs that the fast engine lacks is named (config/families.py MISSING)
    assert "sqrt(hidden_size)" in msg and "(1 + w) RMSNorms" in msg and "5 of every 6" in msg
    msg = refused(_folder(tmp_path, "gemma3"), "model.tokenizer=qwen:", "rollout.engine=hf", "actor.forward=native")
    assert "actor.forward=native" in msg and "actor.forward=hf" in msg
    # the HF paths run any family; a supported one passes with the fast paths
    assert plan(_folder(tmp_path, "gemma3"), "model.tokenizer=qwen:", "rollout.engine=hf", "actor.forward=hf")
    assert plan(_folder(tmp_path, "qwen3"), "model.tokenizer=qwen:", "rollout.engine=fast", "actor.forward=native")


def test_own_weights_auto_is_on_where_a_tp_rank_would_gather_a_sharded_actor_whole():
    sharded = [*TWO_WORKERS, "actor.sharding=fsdp2"]
    assert plan(*sharded, "rollout.tensor_parallel=2").rollout_owns_weights
    assert not plan(*sharded).rollout_owns_weights  # k = 1: the whole model is what the engine reads anyway
    assert not plan(*TWO_WORKERS, "rollout.tensor_parallel=2").rollout_owns_weights  # nothing sharded to gather
    assert not plan(*sharded, "rollout.tensor_parallel=2", "rollout.own_weights=false").rollout_owns_weights
    assert plan("rollout.engine=fast", "rollout.own_weights=true").rollout_owns_weights
    assert plan(*sharded, "rollout.tensor_parallel=2").summary()["rollout_owns_weights"] is True
    msg = refused("rollout.engine=hf", "rollout.own_weights=true")
    assert "rollout.own_weights=true" in msg and "rollout.engine=fast" in msg


def test_gpu_memory_fraction_is_the_fast_engines_on_gpus():
    gpu = ["rollout.engine=fast", "cluster.pools.main.gpus_per_worker=1"]
    assert plan(*gpu, "rollout.gpu_memory_fraction=0.3").config.rollout.gpu_memory_fraction == 0.3
    msg = refused("rollout.engine=hf", "cluster.pools.main.gpus_per_worker=1", "rollout.gpu_memory_fraction=0.3")
    assert "rollout.engine=hf" in msg and "set rollout.engine=fast" in msg
    msg = refused("rollout.engine=fast", "rollout.gpu_memory_fraction=0.3")  # the quickstart's pool is CPU-only
    assert "has no GPUs" in msg and "gpus_per_worker" in msg
    msg = refused(*gpu, "rollout.gpu_memory_fraction=1.5")
    assert msg == "rollout.gpu_memory_fraction must be in (0, 1] (null = a slot for every sample), got 1.5"
