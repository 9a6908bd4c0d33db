"""`auto` precision (config/precision.py): bf16 where matmuls run it natively, the model's precision elsewhere."""
from __future__ import annotations

import logging

import pytest

from fleetrl.config import derive_plan, load_config, precision
from fleetrl.config.precision import resolve_precision


@pytest.fixture
def cpu_bf16(monkeypatch):
    def set_native(native: bool) -> None:
        monkeypatch.setattr(precision, "native_bf16_cpu", lambda: native)
    return set_native


@pytest.mark.parametrize("on_gpu, native, expected", [
    (True, False, "bfloat16"),   # a GPU: bf16 whatever the host CPU
    (False, True, "bfloat16"),   # AVX512-BF16 / AMX CPU
    (False, False, "off"),       # AVX2-only CPU: keep the model's precision
])
def test_auto_autocast_follows_the_device(cpu_bf16, on_gpu, native, expected):
    cpu_bf16(native)
    assert resolve_precision("actor.autocast", "auto", on_gpu, "off") == expected


def test_explicit_settings_are_kept_and_a_slow_bf16_is_warned_about(cpu_bf16, caplog):
    cpu_bf16(False)
    with caplog.at_level(logging.WARNING, logger="fleetrl.config"):
        assert resolve_precision("rollout.compute_dtype", "float32", False, "model") == "float32"
        assert not caplog.records
        assert resolve_precision("rollout.compute_dtype", "bfloat16", False, "model") == "bfloat16"
    assert "rollout.compute_dtype=bfloat16 on a CPU without native bf16" in caplog.text
    assert "set rollout.compute_dtype=auto" in caplog.text


@pytest.mark.parametrize("native, autocast, compute, lora_base, upcast, recompute", [
    (True, "bfloat16", "bfloat16", "bfloat16", False, False),
    # no autocast: the LoRA base stored in bf16 and widened at each matmul (frozen_dtype=bfloat16, as the SmolLM2
    # LoRA example sets); fp32 activations recomputed
    (False, "off", "model", "bfloat16", True, True),
])
def test_plan_resolves_auto_for_the_cpu_pool(cpu_bf16, native, autocast, compute, lora_base, upcast, recompute):
    cpu_bf16(native)
    cfg = load_config("examples/quickstart.yaml", ["actor.autocast=auto", "rollout.compute_dtype=auto",
                                                   "actor.lora.rank=4", "rollout.engine=fast",
                                                   "model.gradient_checkpointing=auto",
                                                   "actor.lora.frozen_dtype=bfloat16"])
    plan = derive_plan(cfg)
    assert (plan.actor_autocast, plan.rollout_compute_dtype, plan.lora_base_dtype) == (autocast, compute, lora_base)
    assert (plan.lora_base_upcast, plan.gradient_checkpointing) == (upcast, recompute)
    assert cfg.actor.autocast == "auto"  # the config keeps what the user wrote; the Plan holds what runs


def test_gradient_checkpointing_auto_is_on_only_for_an_fp32_update_on_a_cpu():
    from fleetrl.config import derive_plan, load_config

    def plan(*o: str):
        return derive_plan(load_config(None, ["model.gradient_checkpointing=auto", *o]))

    assert plan("actor.autocast=off").gradient_checkpointing  # fp32 activations on a CPU: recomputed
    assert not plan("actor.autocast=bfloat16").gradient_checkpointing  # bf16 activations: kept
    assert not plan("actor.autocast=off", "model.gradient_checkpointing=false").gradient_checkpointing
    assert plan("actor.autocast=bfloat16", "model.gradient_checkpointing=true").gradient_checkpointing
    gpu = plan("actor.autocast=off", "cluster.pools={main: {gpus_per_worker: 1}}")
    assert not gpu.gradient_checkpointing  # a GPU's memory is another matter: the user says so
