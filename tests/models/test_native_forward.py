"""Our own Llama/Qwen2 training forward (models/decoder.py, models/native.py) against HF's modelling code, CPU fp32.

The reference is the existing HF path (`sequence_logprobs` padded, `packed_logprobs` packed), so equality here
means the native forward is a drop-in replacement: same log-probs, entropy and parameter gradients."""
from __future__ import annotations

import pytest
import torch
import transformers

from fleetrl.models.decoder import (
    NativeDecoder,
    NativeForwardError,
    decoder_layer,
    packed_mask,
    rope_cos_sin,
)
from fleetrl.models.logprobs import sequence_logprobs
from fleetrl.models.native import bucket_length, compact_rows, packed_native_logprobs, padded_native_logprobs
from fleetrl.models.packing import pack, packed_logprobs

V = 40


def _model(arch: str, *, tied: bool, kv_heads: int = 2, seed: int = 0) -> transformers.PreTrainedModel:
    """4 query heads over `kv_heads` KV heads (GQA); Qwen2 has q/k/v biases, Llama none. rope_theta is not the
    default, so a forward that ignored the config's theta would differ."""
    cls_cfg, cls = ((transformers.Qwen2Config, transformers.Qwen2ForCausalLM) if arch == "qwen2"
                    else (transformers.LlamaConfig, transformers.LlamaForCausalLM))
    cfg = cls_cfg(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=kv_heads, intermediate_size=48, max_position_embeddings=64,
                  tie_word_embeddings=tied, rope_theta=500.0, rms_norm_eps=1e-5, attn_implementation="eager")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(cfg)
        for p in model.parameters():  # HF zero-inits biases; random ones check that they are applied
            if p.dim() == 1 and not torch.all(p == 1):
                p.data.normal_(0, 0.1)
    return model.float().train()


MODELS = {"qwen2_tied_bias": lambda: _model("qwen2", tied=True),
          "llama_untied": lambda: _model("llama", tied=False),
          "llama_mha_tied": lambda: _model("llama", tied=True, kv_heads=4)}


def _batch(prompt_lens, response_lens, P=6, R=7, seed=0):
    """Left-padded prompts, right-padded responses of the given real lengths."""
    g = torch.Generator().manual_seed(seed)
    B = len(prompt_lens)
    pm, rm = torch.zeros(B, P, dtype=torch.long), torch.zeros(B, R, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        pm[i, P - p:], rm[i, :r] = 1, 1
    return (torch.randint(1, V, (B, P), generator=g) * pm, pm, torch.randint(1, V, (B, R), generator=g) * rm, rm)


# Includes a 1-token prompt and a 1-token response (the shift-by-one edges) and a full-width row.
BATCH = ([6, 1, 3, 2], [7, 1, 4, 2])


def _loss_and_grads(model, fn, batch, **kw):
    pr, pm, rs, rm = batch
    adv = torch.tensor([1.0, -2.0, 0.5, 3.0])[:, None]
    model.zero_grad()
    lp, ent = fn(model, pr, pm, rs, rm, temperature=0.9, return_entropy=True, **kw)
    loss = -(lp * adv * rm).sum() / rm.sum() - 0.1 * (ent * rm).sum() / rm.sum()
    loss.backward()
    return lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _assert_same(got, want):
    for a, b in zip(got[:2], want[:2]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert got[2].keys() == want[2].keys()
    for name, g in want[2].items():
        torch.testing.assert_close(got[2][name], g, atol=1e-5, rtol=1e-4, msg=name)


def _padded(decoder, **kw):
    return lambda model, *a, **k: padded_native_logprobs(decoder, model, *a, **k, **kw)


def _packed(decoder, **kw):
    return lambda model, *a, **k: packed_native_logprobs(decoder, model, *a, **k, **kw)


@pytest.mark.parametrize("name", list(MODELS))
def test_padded_native_equals_hf_logprobs_entropy_and_gradients(name):
    model = MODELS[name]()
    want = _loss_and_grads(model, sequence_logprobs, _batch(*BATCH))
    decoder = NativeDecoder(model)
    _assert_same(_loss_and_grads(model, _padded(decoder), _batch(*BATCH)), want)
    _assert_same(_loss_and_grads(model, _padded(decoder, chunk_size=3), _batch(*BATCH)), want)  # chunked head
    _assert_same(_loss_and_grads(model, _padded(decoder, fused_chunk=5), _batch(*BATCH)), want)  # fused head


@pytest.mark.parametrize("name", ["qwen2_tied_bias", "llama_untied"])
@pytest.mark.parametrize("fused", [None, 5])
@pytest.mark.parametrize("attention", ["dense", "varlen", "segments"])
def test_packed_native_equals_hf_packed(name, fused, attention):
    model = MODELS[name]()
    want = _loss_and_grads(model, packed_logprobs, _batch(*BATCH), fused_chunk=fused, attention="sdpa")
    got = _loss_and_grads(model, _packed(NativeDecoder(model), fused_chunk=fused, attention=attention), _batch(*BATCH))
    _assert_same(got, want)


@pytest.mark.parametrize("share", [False, True])
def test_packed_native_flex_block_mask_equals_dense_mask(share):
    # flex_attention runs eagerly on CPU here (its reference implementation, forward only: no CPU backward): the
    # BlockMask must select exactly the dense mask's keys. Gradients through flex are GPU's.
    model = MODELS["qwen2_tied_bias"]().eval()
    decoder = NativeDecoder(model)
    pr, pm, rs, rm = _shared_batch() if share else _batch(*BATCH)
    with torch.no_grad():
        want = packed_native_logprobs(decoder, model, pr, pm, rs, rm, return_entropy=True, attention="dense",
                                      share_prompts=share)
        got = packed_native_logprobs(decoder, model, pr, pm, rs, rm, return_entropy=True, attention="flex",
                                     share_prompts=share)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_gradient_checkpointing_gives_the_same_gradients():
    model = MODELS["llama_untied"]()
    decoder = NativeDecoder(model)
    want = _loss_and_grads(model, _padded(decoder), _batch(*BATCH))
    model.gradient_checkpointing_enable()
    _assert_same(_loss_and_grads(model, _padded(decoder), _batch(*BATCH)), want)
    torch._dynamo.reset()  # and a compiled layer under checkpointing (recomputed in backward)
    _assert_same(_loss_and_grads(model, _padded(NativeDecoder(model, compile_backend="aot_eager")), _batch(*BATCH)),
                 want)
    torch._dynamo.reset()


def test_compiled_layer_fullgraph_matches_eager_and_compiles_once_for_all_layers():
    # backend="aot_eager": dynamo + AOT autograd (the graph capture fullgraph checks and the joint forward/backward
    # graph), without inductor's C++ codegen, which is slow on this 2-core CPU; GPU runs use inductor.
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = MODELS["qwen2_tied_bias"]()
    want = _loss_and_grads(model, _padded(NativeDecoder(model)), _batch(*BATCH))
    got = _loss_and_grads(model, _padded(NativeDecoder(model, compile_backend="aot_eager")), _batch(*BATCH))
    _assert_same(got, want)
    # Two layers, one graph: the layer module is an input, not a guard on its identity (fullgraph=True would
    # have raised on any graph break).
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


def test_compiled_packed_layer_with_dense_mask_matches_eager():
    torch._dynamo.reset()
    model = MODELS["llama_untied"]()
    want = _loss_and_grads(model, _packed(NativeDecoder(model)), _batch(*BATCH))
    got = _loss_and_grads(model, _packed(NativeDecoder(model, compile_backend="aot_eager")), _batch(*BATCH))
    _assert_same(got, want)
    torch._dynamo.reset()


# segments (the CPU default) is the one duck sizing would recompile; ~17 s of tracing, so out of the fast tier.
@pytest.mark.parametrize("attention", ["dense", pytest.param("segments", marks=pytest.mark.slow)])
def test_dynamic_compiled_packed_layer_serves_every_row_length_with_one_compile(attention):
    # CPU compiles the layer with dynamic shapes (workers/actor.py:native_forward): packed rows of any length run
    # through the graphs of the first call, with eager's numbers. The first row is 48 tokens at align 16, one of the
    # model's own sizes (its MLP width): with dynamo's duck sizing it would have been specialised to 48, and the
    # next length recompiled (NativeDecoder traces without duck sizing).
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = MODELS["llama_untied"]()
    model.model.embed_tokens.weight.requires_grad_(False)  # frozen, as under LoRA
    compiled = NativeDecoder(model, compile_backend="aot_eager", dynamic=True)
    short = _batch([12, 10, 8, 6], [4, 4, 3, 1], P=12, R=14)
    long = _batch([12, 12, 12, 12], [14, 14, 14, 14], P=12, R=14)
    graphs = []
    for batch in (short, long):
        _assert_same(_loss_and_grads(model, _packed(compiled, align=16, attention=attention), batch),
                     _loss_and_grads(model, _packed(NativeDecoder(model), align=16, attention=attention), batch))
        graphs.append(counters["stats"]["unique_graphs"])
    # One graph for every layer: the frozen embedding's output is made to require grad like the later layers' input.
    assert graphs == [1, 1], "a new row length, or the first layer, compiled another graph"
    torch._dynamo.reset()


def test_lora_projections_go_through_peft_and_get_gradients():
    from fleetrl.config.schema import LoraConfig
    from fleetrl.models.lora import apply_lora

    model = MODELS["qwen2_tied_bias"]()
    apply_lora(model, LoraConfig(rank=2, alpha=4.0))
    for n, p in model.named_parameters():  # B starts at 0 (adapter = identity); make it matter
        if "lora_B" in n:
            p.data.normal_(0, 0.1)
    want = _loss_and_grads(model, sequence_logprobs, _batch(*BATCH))
    assert any("lora_A" in n for n in want[2])
    _assert_same(_loss_and_grads(model, _padded(NativeDecoder(model)), _batch(*BATCH)), want)
    # peft's lora.Linear traces without a graph break too (fullgraph=True would raise otherwise).
    torch._dynamo.reset()
    _assert_same(_loss_and_grads(model, _padded(NativeDecoder(model, compile_backend="aot_eager")), _batch(*BATCH)),
                 want)
    torch._dynamo.reset()


def test_compact_rows_by_hand():
    # Row 0: prompt [_ a b] response [c _]; row 1: prompt [d e f] response [g h]. Real tokens to the front:
    # row 0 -> a b c, row 1 -> d e f g h; width 6 pads with 0. Response c is predicted from b (column 1);
    # g from f (2), h from g (3); the masked slot of row 0 gets 0.
    pr, pm = torch.tensor([[0, 11, 12], [14, 15, 16]]), torch.tensor([[0, 1, 1], [1, 1, 1]])
    rs, rm = torch.tensor([[13, 0], [17, 18]]), torch.tensor([[1, 0], [1, 1]])
    ids, pred = compact_rows(pr, pm, rs, rm, width=6)
    assert ids.tolist() == [[11, 12, 13, 0, 0, 0], [14, 15, 16, 17, 18, 0]]
    assert pred.tolist() == [[1, 0], [2, 3]]


def test_bucket_length_quarter_octaves():
    # 2^k < n <= 2^(k+1) rounds up to a multiple of 2^(k-2), at least 64: 100 -> 64-steps -> 128; 129 -> 192;
    # 300 -> 320; 385 -> 448; 1100 -> 256-steps -> 1280; 2049 -> 512-steps -> 2560.
    got = [bucket_length(n) for n in (1, 64, 100, 129, 300, 385, 1024, 1100, 2049)]
    assert got == [64, 64, 128, 192, 320, 448, 1024, 1280, 2560]


def test_packed_mask_keeps_samples_apart():
    # samples {0,1} and {2,3,4} (docs 0 and 1, no shared prompt); query 3 sees keys 2, 3 only.
    mask = packed_mask(torch.tensor([0, 0, 1, 1, 1]), torch.zeros(5, dtype=torch.long))[0, 0]
    assert mask[3].tolist() == [False, False, True, True, False]
    assert mask[1].tolist() == [True, True, False, False, False]


def test_packed_mask_shared_prompt_by_hand():
    # One doc: prompt p0 p1 (segment 0), response A = a0 a1 (segment 1), response B = b0 (segment 2); then a pad
    # doc. b0 sees the prompt and itself, not A; a1 sees the prompt, a0 and itself; p1 sees p0 and itself.
    doc, seg = torch.tensor([0, 0, 0, 0, 0, 1]), torch.tensor([0, 0, 1, 1, 2, 0])
    mask = packed_mask(doc, seg)[0, 0].int().tolist()
    assert mask[4] == [1, 1, 0, 0, 1, 0]
    assert mask[3] == [1, 1, 1, 1, 0, 0]
    assert mask[1] == [1, 1, 0, 0, 0, 0]
    assert mask[5] == [0, 0, 0, 0, 0, 1]


# Two groups of samples that share a prompt (3 of a 4-token prompt, 2 of a 1-token one), responses of 1 to 7
# tokens: the update's forward runs each prompt once.
SHARED_GROUPS = ([4, 4, 4, 1, 1], [7, 1, 3, 2, 5])


def _shared_batch():
    pr, pm, rs, rm = _batch(*SHARED_GROUPS)
    pr[1:3], pr[4] = pr[0], pr[3]  # same prompt tokens within each group
    return pr, pm, rs, rm


@pytest.mark.parametrize("name", ["qwen2_tied_bias", "llama_untied"])
@pytest.mark.parametrize("fused", [None, 5])
@pytest.mark.parametrize("attention", ["dense", "varlen", "segments"])  # varlen: on CPU its per-segment SDPA
def test_shared_prompt_packed_native_equals_padded_hf(name, fused, attention):
    model = MODELS[name]()
    adv = torch.tensor([1.0, -2.0, 0.5, 3.0, -1.0])[:, None]

    def run(fn, **kw):
        pr, pm, rs, rm = _shared_batch()
        model.zero_grad()
        lp, ent = fn(model, pr, pm, rs, rm, temperature=0.9, return_entropy=True, **kw)
        loss = -(lp * adv * rm).sum() / rm.sum() - 0.1 * (ent * rm).sum() / rm.sum()
        loss.backward()
        return lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    want = run(sequence_logprobs)
    _assert_same(run(_packed(NativeDecoder(model), fused_chunk=fused, share_prompts=True, attention=attention)), want)


def test_shared_prompt_pack_layout_by_hand():
    # Rows 0 and 1 share prompt [11 12]; row 2 has [13]. Packed: 11 12 | 21 22 | 31 | 13 | 41 + pads.
    pr, pm = torch.tensor([[11, 12], [11, 12], [0, 13]]), torch.tensor([[1, 1], [1, 1], [0, 1]])
    rs, rm = torch.tensor([[21, 22], [31, 0], [41, 0]]), torch.tensor([[1, 1], [1, 0], [1, 0]])
    pk = pack(pr, pm, rs, rm, share_prompts=True)
    assert pk.real_tokens == 7 and pk.input_ids_1N[0, :7].tolist() == [11, 12, 21, 22, 31, 13, 41]
    assert pk.position_ids_1N[0, :7].tolist() == [0, 1, 2, 3, 2, 0, 1]  # row 1's response continues its prompt
    assert pk.doc_N[:7].tolist() == [0, 0, 0, 0, 0, 1, 1] and pk.seg_N[:7].tolist() == [0, 0, 1, 1, 2, 0, 3]
    # 21 and 31 are predicted by the prompt's last token (index 1); 22 by 21 (2); 41 by 13 (5).
    assert pk.pred_index_M.tolist() == [1, 2, 1, 5] and pk.targets_M.tolist() == [21, 22, 31, 41]
    unshared = pack(pr, pm, rs, rm)
    assert unshared.real_tokens == 9 and unshared.pred_index_M.tolist() == [1, 2, 5, 7]


def test_unsupported_architecture_names_the_type_and_the_supported_ones():
    cfg = transformers.GPT2Config(vocab_size=V, n_embd=16, n_layer=1, n_head=2)
    with pytest.raises(NativeForwardError, match=r"\['llama', 'qwen2', 'qwen3', 'mistral'\]; this model's type is "
                                                 r"'gpt2'.*actor.forward=hf"):
        NativeDecoder(transformers.GPT2LMHeadModel(cfg))


def test_attention_dropout_is_refused():
    model = MODELS["llama_untied"]()
    model.config.attention_dropout = 0.1
    with pytest.raises(NativeForwardError, match="attention_dropout=0.1"):
        NativeDecoder(model)


def test_decoder_layer_is_causal():
    # Changing the last token must not change any earlier position's output.
    model = MODELS["qwen2_tied_bias"]().eval()
    spec = NativeDecoder(model).spec
    x = torch.randn(1, 5, 32)
    pos = torch.arange(5)[None]
    cos, sin = rope_cos_sin(model, pos, x.dtype)
    layer = model.model.layers[0]
    y = decoder_layer(layer, x, cos, sin, spec)
    x2 = x.clone()
    x2[0, 4] += 1.0
    y2 = decoder_layer(layer, x2, cos, sin, spec)
    torch.testing.assert_close(y[:, :4], y2[:, :4])
    assert not torch.allclose(y[:, 4], y2[:, 4])
