"""random: shapes built on the meta device and drawn where they live (models/meta_init.py): the same seed gives the
same weights, build after build and whether drawn at once or after a detour on the meta device."""
import pytest
import torch

from fleetrl.models import meta_init
from fleetrl.models.hf import load_causal_lm
from fleetrl.models.shapes import random_model

SHAPE = "random:qwen2.5-test"  # two small layers over Qwen2.5's vocabulary


def _equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_same_seed_same_weights_build_after_build():
    a, b = load_causal_lm(SHAPE), load_causal_lm(SHAPE)
    assert _equal(a, b)
    assert meta_init.built_alike(a) and not meta_init.is_deferred(a)
    assert not _equal(a, random_model(SHAPE, torch.float32, seed=1))
    assert a.lm_head.weight is a.model.embed_tokens.weight, "a tied head stays tied through to_empty"
    # transformers' initialisation: N(0, 0.02) matrices, zero biases, unit norms; rotary frequencies recomputed
    assert a.model.embed_tokens.weight.std().item() == pytest.approx(0.02, rel=0.01)
    assert torch.equal(a.model.layers[0].self_attn.q_proj.bias, torch.zeros(64))
    assert torch.equal(a.model.norm.weight, torch.ones(64))
    head_dim = 64 // 4
    want = 1.0 / (1_000_000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    assert torch.equal(a.model.rotary_emb.inv_freq, want)


def test_meta_then_materialize_equals_a_direct_draw_and_reports_its_fingerprint():
    direct = random_model(SHAPE, torch.bfloat16)
    later = random_model(SHAPE, torch.bfloat16, device="meta")
    assert meta_init.is_deferred(later) and later.model.embed_tokens.weight.is_meta
    stats = meta_init.materialize(later, "cpu")
    assert not meta_init.is_deferred(later) and later.model.embed_tokens.weight.dtype == torch.bfloat16
    assert _equal(direct, later)
    want = meta_init.fingerprint(direct)
    assert list(stats) == list(want) == ["model.layers.0.self_attn.k_proj.weight",
                                         "model.layers.0.self_attn.v_proj.weight"]
    assert all(torch.equal(stats[k], want[k]) for k in want)


def test_meta_only_for_random_shapes_and_unknown_modules_are_refused():
    with pytest.raises(ValueError, match="only a random: shape can be built on the meta device"):
        load_causal_lm("tiny:", device="meta")
    model = meta_init.build_on_meta(lambda: torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.PReLU()), seed=0)
    with pytest.raises(ValueError, match="no initialisation for PReLU.weight"):
        meta_init.materialize(model, "cpu")


def test_lora_adapters_injected_on_meta_start_as_the_base_and_leave_its_draw_alone():
    """The 72B LoRA recipe's path: adapters injected into a meta model, the whole drawn after sharding. B = 0 (the
    adapted model is its base), A within peft's kaiming bound, and the base equals the plain shape's draw."""
    from fleetrl.config.schema import LoraConfig
    from fleetrl.models.lora import apply_lora

    plain = random_model(SHAPE, torch.float32)
    model = random_model(SHAPE, torch.float32, device="meta")
    apply_lora(model, LoraConfig(rank=4, alpha=8.0))
    meta_init.materialize(model, "cpu")
    params = dict(model.named_parameters())
    a = params["model.layers.0.self_attn.q_proj.lora_A.default.weight"]
    b = params["model.layers.0.self_attn.q_proj.lora_B.default.weight"]
    assert a.shape == (4, 64) and 0 < a.abs().max().item() <= 1 / 8 and a.std().item() > 0.03  # 1/sqrt(64)
    assert torch.equal(b, torch.zeros(64, 4))
    base = {n.replace(".base_layer", ""): p for n, p in params.items() if ".lora_" not in n}
    assert base.keys() == dict(plain.named_parameters()).keys()
    assert all(torch.equal(base[n], p) for n, p in plain.named_parameters())
    ids = torch.tensor([[3, 9, 27, 81]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, atol=0, rtol=0)


def test_a_base_narrowed_on_meta_is_the_plain_draw_rounded_and_ranks_compare_an_adapter_that_varies():
    """store_frozen_base(bf16) before the draw (a CPU LoRA actor of an fp32 model): each frozen weight equals the
    fp32 draw of the plain shape rounded to bf16, as the separate rollout pool's plain model has it; the trainable
    matrices the ranks fingerprint are A's (B's are zero whatever the seed)."""
    from fleetrl.config.schema import LoraConfig
    from fleetrl.models.lora import apply_lora, store_frozen_base

    plain = random_model(SHAPE, torch.float32)
    model = random_model(SHAPE, torch.float32, device="meta")
    apply_lora(model, LoraConfig(rank=4, alpha=8.0))
    store_frozen_base(model, torch.bfloat16, upcast=True)
    stats = meta_init.materialize(model, "cpu")
    params = dict(model.named_parameters())
    q = params["model.layers.0.self_attn.q_proj.base_layer.weight"]
    assert q.dtype == torch.bfloat16
    assert torch.equal(q, plain.model.layers[0].self_attn.q_proj.weight.to(torch.bfloat16))
    assert torch.equal(params["model.embed_tokens.weight"], plain.model.embed_tokens.weight)  # not narrowed
    trainable = [n for n in stats if params[n].requires_grad]
    assert trainable and all(".lora_A." in n for n in trainable)
