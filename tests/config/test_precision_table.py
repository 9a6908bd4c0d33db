"""Which dtype combinations the Plan accepts (config/precision.py, config/plan.py): every one it accepts runs, and it
refuses the others before anything starts, saying which keys to change.

Hand-written from what each combination did when run (tiny model, 2 GRPO steps, 2026-12: every CPU cell below on
CPU; the GPU cells from the GPU failures they name):
- HF: rollout.engine=hf decodes in model.dtype (transformers' generate on the model itself), so a compute_dtype
  other than the model's would be silently ignored; auto resolves to `model` there.
- FP16: model.dtype=float16 trained on CPU turns weights with a zero gradient into NaN at the first step (torch's
  CPU AdamW adds eps=1e-8 in fp16, where it is 0); the next generate failed on NaN probabilities.
- FLASH (second table): FlashAttention (the native forward's varlen kernel, transformers' flash_attention_2/3)
  takes fp16/bf16 only; before this check, fp32 q/k/v failed the first GPU update.
Everything else ran, including fp32 master weights with bf16 decode under CUDA graphs (the fast engine's kept copy,
engines/fast/cast.py) and with bf16 autocast in the native forward (models/decoder.py casts q/k/v for its kernels).
"""
from __future__ import annotations

import itertools
import re

import pytest

from fleetrl.config import ConfigError, derive_plan, load_config, precision

GPU = "cluster.pools.main.gpus_per_worker=1"
REFUSED = {"HF": "needs rollout.engine=fast: the hf engine decodes in model.dtype",
           "FP16": "AdamW's eps (1e-8) is 0 in fp16"}
COMPUTE = ("model", "auto", "bfloat16", "float16", "float32")

# device, model.dtype, rollout.engine | outcome for each rollout.compute_dtype in COMPUTE. actor.autocast and
# actor.forward do not change a cell: each is checked with every value of both (padded micro-batches; packed
# attention is the second table).
TABLE = """
gpu float32  hf   | ok   ok   HF   HF   ok
gpu float32  fast | ok   ok   ok   ok   ok
gpu bfloat16 hf   | ok   ok   ok   HF   HF
gpu bfloat16 fast | ok   ok   ok   ok   ok
gpu float16  hf   | ok   ok   HF   ok   HF
gpu float16  fast | ok   ok   ok   ok   ok
cpu float32  hf   | ok   ok   HF   HF   ok
cpu float32  fast | ok   ok   ok   ok   ok
cpu bfloat16 hf   | ok   ok   ok   HF   HF
cpu bfloat16 fast | ok   ok   ok   ok   ok
cpu float16  hf   | FP16 FP16 FP16 FP16 FP16
cpu float16  fast | FP16 FP16 FP16 FP16 FP16
"""


def _cells() -> list[tuple[str, str, str, str, str]]:
    cells = []
    for line in TABLE.strip().splitlines():
        keys, outcomes = line.split("|")
        device, model, engine = keys.split()
        cells += [(device, model, engine, c, o) for c, o in zip(COMPUTE, outcomes.split(), strict=True)]
    return cells


@pytest.fixture(autouse=True)
def _avx2_cpu(monkeypatch):
    """A CPU without native bf16, so `auto` resolves the same on every host: the model's precision."""
    monkeypatch.setattr(precision, "native_bf16_cpu", lambda: False)


def _plan(*overrides: str):
    return derive_plan(load_config(None, list(overrides)))


@pytest.mark.parametrize("device, model, engine, compute, outcome", _cells())
def test_dtype_combinations(device, model, engine, compute, outcome):
    for autocast, forward in itertools.product(("'off'", "auto", "bfloat16", "float16"), ("hf", "native")):
        keys = [f"model.dtype={model}", f"rollout.engine={engine}", f"rollout.compute_dtype={compute}",
                f"actor.autocast={autocast}", f"actor.forward={forward}", *([GPU] if device == "gpu" else [])]
        if outcome != "ok":
            with pytest.raises(ConfigError, match=re.escape(REFUSED[outcome])):
                _plan(*keys)
            continue
        plan = _plan(*keys)
        # what runs: auto is bf16 on a GPU, the model's precision on this CPU; the hf engine decodes in model.dtype
        want_compute = "model" if engine == "hf" else {"auto": "bfloat16" if device == "gpu" else "model"}.get(compute, compute)
        want_autocast = {"auto": "bfloat16" if device == "gpu" else "off", "'off'": "off"}.get(autocast, autocast)
        assert (plan.rollout_compute_dtype, plan.actor_autocast) == (want_compute, want_autocast), keys


PACKED = ["algorithm.micro_batch_tokens=512", "data.prompts_per_step=4", "rollout.n=4"]
RECOMPUTE = "algorithm.mini_batch_prompts=2"  # two mini-batches: the old log-probs are recomputed
SHARE = "actor.share_prompts=true"
LORA = ["actor.lora.rank=4", "rollout.engine=fast"]  # LoRA base kept in the autocast dtype (Plan.lora_base_dtype)

# model.dtype, actor.autocast, actor.forward, actor.packed_attention, extra keys | refused pass (None: accepted),
# Plan.flash_attention_ok. On a GPU pool, packed micro-batches.
FLASH = [
    ("float32", "'off'", "native", "varlen", [], "the update feeds it float32", False),
    ("float32", "bfloat16", "native", "varlen", [], None, True),  # fp32 master weights + bf16 autocast
    ("float32", "bfloat16", "native", "varlen", [RECOMPUTE], "the old log-prob recompute", False),
    ("float32", "bfloat16", "native", "varlen", [RECOMPUTE, *LORA], None, True),  # that pass runs under autocast
    ("bfloat16", "'off'", "native", "varlen", [RECOMPUTE, "algorithm.kl.placement=loss"], None, True),
    # the frozen fp32 reference runs HF's forward, which takes flex for the native-only varlen (workers/actor.py)
    ("float32", "bfloat16", "native", "varlen", ["algorithm.kl.placement=loss"], None, True),
    ("float16", "'off'", "native", "varlen", [], None, True),
    ("float32", "'off'", "native", "auto", [SHARE], None, False),  # auto takes flex, not varlen, here
    ("float32", "bfloat16", "native", "auto", [SHARE], None, True),  # ... and varlen here
    ("float32", "bfloat16", "native", "auto", [SHARE, RECOMPUTE], None, False),
    ("float32", "'off'", "native", "flex_attention", [RECOMPUTE], None, False),
    ("float32", "'off'", "hf", "flash_attention_2", [], "the update feeds it float32", False),
    ("float32", "bfloat16", "hf", "flash_attention_2", [], None, True),
    ("float32", "bfloat16", "hf", "flash_attention_3", ["algorithm.kl.placement=loss"],
     "the reference log-prob pass feeds it float32", True),  # a frozen fp32 copy, outside autocast
    ("float32", "'off'", "hf", "sdpa", [RECOMPUTE], None, False),
]


@pytest.mark.parametrize("model, autocast, forward, attention, extra, refused, flash_ok", FLASH)
def test_flash_attention_needs_half_precision_inputs_on_a_gpu(model, autocast, forward, attention, extra, refused,
                                                              flash_ok):
    keys = [f"model.dtype={model}", f"actor.autocast={autocast}", f"actor.forward={forward}",
            f"actor.packed_attention={attention}", *PACKED, *extra]
    if refused is not None:
        with pytest.raises(ConfigError, match=f"packed_attention={attention} runs FlashAttention.*{refused}"):
            _plan(GPU, *keys)
    else:
        assert _plan(GPU, *keys).flash_attention_ok is flash_ok
    if model != "float16":  # (fp16 is refused on CPU: the first table)
        _plan(*keys)  # a CPU pool accepts every one: varlen segments run through SDPA there, in any dtype


def test_the_refusals_say_what_to_change():
    with pytest.raises(ConfigError) as err:
        _plan(GPU, "model.dtype=float32", "actor.autocast='off'", "actor.forward=native",
              "actor.packed_attention=varlen", *PACKED)
    assert str(err.value) == ("actor.packed_attention=varlen runs FlashAttention, which takes fp16/bf16 only, but the "
                              "update feeds it float32 on a GPU; set actor.autocast=auto (bf16 on a GPU) or "
                              "model.dtype=bfloat16, or set actor.packed_attention=flex_attention (any dtype)")
    with pytest.raises(ConfigError) as err:
        _plan("rollout.engine=hf", "rollout.compute_dtype=bfloat16")
    assert str(err.value) == ("rollout.compute_dtype=bfloat16 needs rollout.engine=fast: the hf engine decodes in "
                              "model.dtype=float32; set rollout.compute_dtype=model (or auto), or rollout.engine=fast")


def test_the_smollm2_examples_mixed_precision_is_accepted_on_a_gpu():
    """examples/grpo_smollm2_lora.yaml on a GPU: fp32 master weights, bf16 decode (the fast engine's kept copy) and
    bf16 autocast; its shared-prompt packed rows take the flash varlen kernel (tests/integration/
    test_smollm2_gpu.py trains it)."""
    plan = derive_plan(load_config("examples/grpo_smollm2_lora.yaml", [GPU]))
    assert (plan.config.model.dtype, plan.rollout_compute_dtype, plan.actor_autocast) == ("float32", "bfloat16",
                                                                                          "bfloat16")
    assert plan.flash_attention_ok and plan.lora_base_dtype == "bfloat16"
