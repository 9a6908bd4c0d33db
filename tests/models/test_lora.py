"""LoRA on the tiny Llama (2 layers, hidden 64, 7 projections per layer): target resolution and its errors, one
training step moves the adapters only, the reference (adapters off) is the base model bit for bit, and the
merged weights (export, weight sync, fast engine) compute what the adapted model computes."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from fleetrl.config.schema import LoraConfig, OptimConfig
from fleetrl.engines.training import TrainingEngine
from fleetrl.models.hf import load_causal_lm
from fleetrl.models.logprobs import sequence_logprobs
from fleetrl.models.lora import (
    LoraTargetError,
    adapter_keys,
    apply_lora,
    merged_state_dict,
    resolve_targets,
    target_weight_names,
)
from fleetrl.workers.weight_bus import receive_layout, sync_state

TINY = "tiny:"  # hidden 64, intermediate 128, 2 layers, untied head (fleetrl/models/tiny.py defaults)
PROMPTS = torch.tensor([[5, 6, 7, 8], [0, 9, 10, 11]])
PROMPT_MASK = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
RESPONSES = torch.tensor([[12, 13, 14], [15, 16, 1]])
RESPONSE_MASK = torch.ones_like(RESPONSES)


def _logp(model: torch.nn.Module) -> torch.Tensor:
    return sequence_logprobs(model, PROMPTS, PROMPT_MASK, RESPONSES, RESPONSE_MASK)[0]


def _trained(targets: tuple[str, ...] = ("all-linear",), steps: int = 2):
    """A tiny model with rank-4 adapters after `steps` optimiser steps that raise the responses' log-likelihood."""
    model = load_causal_lm(TINY)
    adapters = apply_lora(model, LoraConfig(rank=4, alpha=8.0, targets=targets))
    engine = TrainingEngine(model, OptimConfig(lr=1e-2))
    for _ in range(steps):
        engine.step(iter([None]), lambda _: (-_logp(model).mean(), {}))
    return model, adapters, engine


def test_targets_resolve_by_suffix_in_module_order():
    model = load_causal_lm(TINY)
    assert resolve_targets(model, ("v_proj", "self_attn.q_proj")) == [
        "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj",
        "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.v_proj"]
    everything = resolve_targets(model, ("all-linear",))
    assert len(everything) == 2 * 7 and "lm_head" not in everything  # 7 projections per layer, never the head


def test_unknown_target_names_the_field_and_lists_module_names():
    model = load_causal_lm(TINY)
    with pytest.raises(LoraTargetError, match=r"actor.lora.targets: \['qkv'\] match no linear layer.*"
                                              r"\['down_proj', 'gate_proj', 'k_proj', 'lm_head', 'o_proj'"):
        resolve_targets(model, ("q_proj", "qkv"))
    assert resolve_targets(model, ("lm_head",)) == ["lm_head"]  # tiny's head is untied
    model.lm_head.weight = model.model.embed_tokens.weight
    with pytest.raises(LoraTargetError, match="selects the LM head.*ties to its input embedding"):
        resolve_targets(model, ("lm_head",))


def test_a_step_changes_only_adapter_parameters():
    base = load_causal_lm(TINY).state_dict()
    model, _, engine = _trained(steps=1)
    # 14 adapted layers x (A, B) = 28 trainable tensors; Adam holds state for exactly those
    assert len(adapter_keys(model)) == 28
    assert sum(len(g["params"]) for g in engine.optimizer.param_groups) == 28
    assert len(engine.optimizer.state) == 28
    for key, tensor in model.state_dict().items():
        if ".lora_" in key:
            continue
        assert torch.equal(tensor, base[key.replace(".base_layer.", ".")]), f"frozen {key} changed"
    b = model.model.layers[0].self_attn.q_proj.lora_B["default"].weight
    assert b.abs().sum() > 0  # B starts at zero; one Adam step moves every entry by about lr


def test_reference_with_adapters_off_is_the_base_model_exactly():
    model, adapters, _ = _trained()
    base_logp = _logp(load_causal_lm(TINY))
    with adapters.disable_adapter():
        ref_logp = _logp(model)
    assert torch.equal(ref_logp, base_logp)
    assert not torch.allclose(_logp(model), base_logp, atol=1e-3)  # the adapters did change the policy


def test_merged_state_computes_what_the_adapted_model_computes():
    model, _, _ = _trained(targets=("q_proj", "v_proj", "down_proj"))
    plain = load_causal_lm(TINY)
    plain.load_state_dict(merged_state_dict(model), strict=True)
    assert torch.allclose(_logp(plain), _logp(model), atol=1e-5)


def test_weight_sync_sends_only_the_adapted_projections_in_the_receivers_order():
    cfg = LoraConfig(rank=4, targets=("q_proj", "up_proj"))
    model = load_causal_lm(TINY)
    apply_lora(model, cfg)
    sent = sync_state(model, cfg)
    receiver = load_causal_lm(TINY)
    own, partial = receive_layout(receiver, cfg)
    assert partial and [n for n, _ in sent] == [n for n, _ in own] == target_weight_names(receiver, cfg)
    assert [n for n, _ in sent] == ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight",
                                    "model.layers.1.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight"]
    assert all(t.shape == o.shape and t.dtype == o.dtype for (_, t), (_, o) in zip(sent, own))


def test_fast_engine_decodes_with_the_merged_adapters():
    from fleetrl.engines.fast import FastRolloutEngine
    from fleetrl.engines.hf import HFRolloutEngine
    from fleetrl.engines.protocol import SamplingParams
    from fleetrl.models.hf import load_tokenizer

    model, _, engine = _trained(targets=("all-linear", "lm_head"))
    tokenizer = load_tokenizer(TINY)
    greedy = SamplingParams(max_new_tokens=5, temperature=0.0)
    fast = FastRolloutEngine(model, tokenizer, device="cpu", max_batch=4, max_seq_len=64)
    reference = HFRolloutEngine(model, tokenizer)
    for _ in range(2):  # the second round checks that an update reaches the engine without a sync
        a, b = fast.generate(PROMPTS, PROMPT_MASK, greedy), reference.generate(PROMPTS, PROMPT_MASK, greedy)
        assert torch.equal(a.responses, b.responses)
        assert torch.allclose(a.logprobs, b.logprobs, atol=1e-5)
        engine.step(iter([None]), lambda _: (-_logp(model).mean(), {}))
    assert fast._fwd.merged is None  # on CPU the merged copy lives for one call only


def test_merging_into_the_decode_dtype_rounds_once_as_casting_the_merge_does():
    # merged_weights(dtype=bf16) rounds each W + dW as it is made (no fp32 copy of every projection at once); the
    # result is bit for bit the old path's fp32 merge then cast, and only the merges are new bf16 tensors.
    from fleetrl.engines.fast.arch import cast_weights, merged_weights

    model, _, _ = _trained(targets=("all-linear", "lm_head"))
    early = cast_weights(merged_weights(model, dtype=torch.bfloat16), torch.bfloat16)
    late = cast_weights(merged_weights(model), torch.bfloat16)
    for a, b in zip(early.layers, late.layers):
        for f in type(a).__slots__:
            x, y = getattr(a, f), getattr(b, f)
            assert (x is None and y is None) or (x.dtype == torch.bfloat16 and torch.equal(x, y)), f
    assert torch.equal(early.lm_head, late.lm_head) and torch.equal(early.embed, late.embed)


def test_export_writes_merged_full_weights(tmp_path):
    from fleetrl.checkpoint.export import export_hf
    from fleetrl.workers.state import save_trainable

    model, _, engine = _trained()
    ckpt = tmp_path / "step_2"
    save_trainable(ckpt / "actor", engine, rank=0)
    lora = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": ["all-linear"]}
    (ckpt / "meta.json").write_text(json.dumps({"step": 2, "model_path": TINY, "tokenizer_path": TINY,
                                                "dtype": "float32", "lora": lora}))
    out = export_hf(ckpt, tmp_path / "hf")
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    assert not any(".lora_" in k or "base_layer" in k for k in exported.state_dict())
    model.eval()
    with torch.no_grad():
        ids = torch.tensor([[5, 6, 7, 8, 12, 13]])
        assert (exported(ids).logits - model(ids).logits).abs().max() < 1e-5


def test_plan_checks_the_numbers_and_decides_where_the_reference_comes_from():
    from fleetrl.config import derive_plan, load_config
    from fleetrl.config.load import ConfigError

    with pytest.raises(ConfigError, match=r"actor.lora needs rank >= 1.*got rank=0"):
        derive_plan(load_config(None, ["actor.lora={rank: 0}"]))
    with pytest.raises(ConfigError, match=r"actor.lora.targets must list module names"):
        derive_plan(load_config(None, ["actor.lora={targets: []}"]))
    kl = ["algorithm.kl.placement=loss", "actor.lora.rank=4"]
    plan = derive_plan(load_config(None, kl))
    assert plan.config.actor.lora == LoraConfig(rank=4) and plan.ref_from_actor
    separate_ref = ["cluster.pools={main: {}, ref: {}}", "cluster.roles.ref=ref"]
    assert not derive_plan(load_config(None, [*kl, *separate_ref])).ref_from_actor
    assert not derive_plan(load_config(None, ["algorithm.kl.placement=loss"])).ref_from_actor  # no LoRA


def test_frozen_base_in_the_autocast_dtype_trains_the_same_function_bit_for_bit():
    # Under bf16 autocast every matmul rounds the frozen weight to bf16; keeping it in bf16 makes that rounding
    # once, so the loss and the adapters' gradients are identical, and the weights take half the bytes.
    from fleetrl.models.lora import store_frozen_base

    def loss_and_grads(narrow: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        torch.manual_seed(0)
        model = load_causal_lm(TINY)
        apply_lora(model, LoraConfig(rank=4, alpha=8.0))
        for name, p in model.named_parameters():  # B starts at zero; give it values so every path is exercised
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1)
        if narrow:
            # 2 layers x 7 projections; hidden 64, intermediate 128: 4 x 64^2 + 3 x 64 x 128 per layer, 2 bytes each
            assert store_frozen_base(model, torch.bfloat16) == 2 * (4 * 64 * 64 + 3 * 64 * 128) * 2
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = -_logp(model).sum()
        loss.backward()
        return loss.detach(), [p.grad for p in model.parameters() if p.requires_grad]

    (wide_loss, wide_grads), (narrow_loss, narrow_grads) = loss_and_grads(False), loss_and_grads(True)
    assert torch.equal(wide_loss, narrow_loss)
    assert all(torch.equal(a, b) for a, b in zip(wide_grads, narrow_grads))


def test_merge_of_a_narrow_base_comes_back_in_the_adapters_dtype():
    from fleetrl.models.lora import lora_layers, merged_weight, store_frozen_base

    model, _, _ = _trained()
    store_frozen_base(model, torch.bfloat16)
    layer = next(iter(lora_layers(model).values()))
    merged = merged_weight(layer)
    assert merged.dtype == torch.float32
    expected = layer.get_base_layer().weight.float() + layer.get_delta_weight("default")
    assert torch.equal(merged, expected)


def test_plan_keeps_the_lora_base_in_the_autocast_dtype_unless_hf_generates_with_it():
    from fleetrl.config import derive_plan, load_config

    lora = ["actor.lora.rank=4", "actor.autocast=bfloat16", "rollout.engine=fast"]
    assert derive_plan(load_config(None, lora)).lora_base_dtype == "bfloat16"
    assert derive_plan(load_config(None, [*lora[:2], "rollout.engine=hf"])).lora_base_dtype is None  # colocated
    assert not derive_plan(load_config(None, lora)).lora_base_upcast
    off = derive_plan(load_config(None, [lora[0], "actor.autocast=off"]))  # no autocast: the fp32 base by default
    assert (off.lora_base_dtype, off.lora_base_upcast) == (None, False)
    narrow = [lora[0], "actor.autocast=off", "actor.lora.frozen_dtype=bfloat16"]  # bf16 storage, fp32 matmuls
    assert (derive_plan(load_config(None, narrow)).lora_base_dtype, derive_plan(load_config(None, narrow))
            .lora_base_upcast) == ("bfloat16", True)
    hf = derive_plan(load_config(None, [*narrow, "rollout.engine=hf"]))  # the HF engine calls the widening modules
    assert (hf.lora_base_dtype, hf.lora_base_upcast) == ("bfloat16", True)
    assert derive_plan(load_config(None, [*lora, "actor.lora.frozen_dtype=model"])).lora_base_dtype is None
    assert derive_plan(load_config(None, [*lora, "model.dtype=bfloat16"])).lora_base_dtype is None
    assert derive_plan(load_config(None, lora[1:])).lora_base_dtype is None  # no LoRA


def _lora_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = load_causal_lm(TINY)
    apply_lora(model, LoraConfig(rank=4, alpha=8.0))
    for name, p in model.named_parameters():  # B starts at zero; give it values so every path is exercised
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    return model


def test_a_widened_bf16_base_trains_the_fp32_model_of_the_rounded_weights():
    # store_frozen_base(upcast=True) without autocast: the same loss and adapter gradients as an fp32 model whose
    # frozen weights were rounded to bf16 once (widening bf16 -> fp32 is exact), in half the bytes.
    from fleetrl.models.lora import UpcastLinear, lora_layers, store_frozen_base

    def loss_and_grads(model: torch.nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
        loss = -_logp(model).sum()
        loss.backward()
        return loss.detach(), [p.grad for p in model.parameters() if p.requires_grad]

    rounded = _lora_model()
    with torch.no_grad():
        for layer in lora_layers(rounded).values():
            w = layer.get_base_layer().weight
            w.copy_(w.bfloat16().float())
    widened = _lora_model()
    assert store_frozen_base(widened, torch.bfloat16, upcast=True) == 2 * (4 * 64 * 64 + 3 * 64 * 128) * 2
    bases = [layer.get_base_layer() for layer in lora_layers(widened).values()]
    assert all(type(b) is UpcastLinear and b.weight.dtype == torch.bfloat16 for b in bases)
    (ref_loss, ref_grads), (loss, grads) = loss_and_grads(rounded), loss_and_grads(widened)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-5)
    for a, b in zip(ref_grads, grads):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_a_widened_base_keeps_no_fp32_copy_of_its_weights_for_backward():
    # The memory the narrow base saves would come back at the step's peak if autograd kept each layer's widened
    # weight from forward to backward: nothing saved for backward is an fp32 tensor of a projection's shape.
    from fleetrl.models.lora import lora_layers, store_frozen_base

    model = _lora_model()
    store_frozen_base(model, torch.bfloat16, upcast=True)
    shapes = {tuple(layer.get_base_layer().weight.shape) for layer in lora_layers(model).values()}
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = -_logp(model).sum()
    loss.backward()
    weights = [t for t in saved if tuple(t.shape) in shapes]
    assert weights and all(t.dtype == torch.bfloat16 for t in weights)
