"""The native training forward (models/decoder.py, models/native.py) on Qwen3 and Mistral against HF's modelling
code, CPU fp32: log-probs, entropy and every parameter's gradient (Qwen3's q_norm / k_norm weights included),
padded and packed; and the sliding-window refusals.

The references and helpers are test_native_forward.py's, so these are the Llama/Qwen2 checks on two more families."""
from __future__ import annotations

import pytest
import torch
import transformers

from fleetrl.models.decoder import NativeDecoder, NativeForwardError
from fleetrl.models.logprobs import sequence_logprobs
from fleetrl.models.native import packed_native_logprobs, padded_native_logprobs
from fleetrl.models.packing import packed_logprobs
from tests.models.test_native_forward import (
    BATCH,
    V,
    _assert_same,
    _batch,
    _loss_and_grads,
    _packed,
    _padded,
    _shared_batch,
)


def _model(arch: str, *, tied: bool = False, bias: bool = False, **config: object) -> transformers.PreTrainedModel:
    """4 query heads over 2 KV heads. Qwen3: head_dim 16 over hidden 32 (q is 64 wide), q_norm / k_norm, with
    `bias` q/k/v/o biases; Mistral: a sliding window wider than any test sample unless `config` narrows it. Every
    1-d parameter is drawn (HF inits norms to ones and biases to zeros), so a forward that skipped one would differ."""
    common = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=48, max_position_embeddings=64, tie_word_embeddings=tied, rope_theta=500.0,
                  rms_norm_eps=1e-5, attn_implementation="eager")
    if arch == "qwen3":
        cfg, cls = transformers.Qwen3Config(**common, head_dim=16, attention_bias=bias, **config), \
            transformers.Qwen3ForCausalLM
    else:
        cfg, cls = transformers.MistralConfig(**common, **{"sliding_window": 4096, **config}), \
            transformers.MistralForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = cls(cfg)
        for p in model.parameters():
            if p.dim() == 1:
                p.data.normal_(1.0 if torch.all(p == 1) else 0.0, 0.1)
    return model.float().train()


MODELS = {"qwen3_tied": lambda: _model("qwen3", tied=True),
          "qwen3_bias": lambda: _model("qwen3", bias=True),
          "mistral": lambda: _model("mistral")}


def test_the_models_have_what_the_tests_claim():
    qwen3 = MODELS["qwen3_bias"]()
    att = qwen3.model.layers[0].self_attn
    assert att.q_proj.out_features == 64 != qwen3.config.hidden_size and att.o_proj.bias is not None
    spec = NativeDecoder(qwen3).spec
    assert spec.qk_norm and spec.head_dim == 16
    assert NativeDecoder(MODELS["mistral"]()).spec.attention_window == 4096


@pytest.mark.parametrize("name", list(MODELS))
def test_padded_native_equals_hf_logprobs_entropy_and_gradients(name):
    model = MODELS[name]()
    want = _loss_and_grads(model, sequence_logprobs, _batch(*BATCH))
    assert any("q_norm" in n for n in want[2]) == name.startswith("qwen3")  # its gradients are compared too
    decoder = NativeDecoder(model)
    _assert_same(_loss_and_grads(model, _padded(decoder), _batch(*BATCH)), want)
    _assert_same(_loss_and_grads(model, _padded(decoder, fused_chunk=5), _batch(*BATCH)), want)  # fused head


@pytest.mark.parametrize("name", ["qwen3_tied", "mistral"])
@pytest.mark.parametrize("attention", ["dense", "varlen", "segments"])
def test_packed_native_equals_hf_packed(name, attention):
    model = MODELS[name]()
    want = _loss_and_grads(model, packed_logprobs, _batch(*BATCH), attention="sdpa")
    _assert_same(_loss_and_grads(model, _packed(NativeDecoder(model), attention=attention), _batch(*BATCH)), want)


@pytest.mark.parametrize("name", ["qwen3_bias", "mistral"])
def test_shared_prompt_packed_native_equals_padded_hf(name):
    model = MODELS[name]()
    adv = torch.tensor([1.0, -2.0, 0.5, 3.0, -1.0])[:, None]

    def run(fn, **kw):
        pr, pm, rs, rm = _shared_batch()
        model.zero_grad()
        lp, ent = fn(model, pr, pm, rs, rm, temperature=0.9, return_entropy=True, **kw)
        loss = -(lp * adv * rm).sum() / rm.sum() - 0.1 * (ent * rm).sum() / rm.sum()
        loss.backward()
        return lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    _assert_same(run(_packed(NativeDecoder(model), share_prompts=True, attention="segments")), run(sequence_logprobs))


@pytest.mark.slow  # ~4 s: a dynamo trace and AOT joint graph of the layer
def test_compiled_qwen3_layer_matches_eager():
    # aot_eager: dynamo's fullgraph capture of the q/k-norm branch and the joint graph, without inductor's C++ compile
    model = MODELS["qwen3_tied"]()
    want = _loss_and_grads(model, _padded(NativeDecoder(model)), _batch(*BATCH))
    torch._dynamo.reset()
    _assert_same(_loss_and_grads(model, _padded(NativeDecoder(model, compile_backend="aot_eager")), _batch(*BATCH)),
                 want)
    torch._dynamo.reset()


def test_qwen3_sliding_window_layers_are_refused_by_name():
    model = _model("qwen3", use_sliding_window=True, sliding_window=8, max_window_layers=0)
    with pytest.raises(NativeForwardError, match=r"use_sliding_window=True with max_window_layers=0 gives layers "
                                                 r"\[0, 1\].*actor.forward=hf"):
        NativeDecoder(model)


def test_mistral_window_is_checked_against_the_run_and_each_batch():
    """A window of 8 tokens: refused at load against a longer max_seq_len; without one, a batch whose samples fit
    equals HF (whose mask is then plain causal), and one with a longer sample is refused, padded or packed."""
    model = _model("mistral", sliding_window=8)
    with pytest.raises(NativeForwardError, match=r"sliding_window=8 is shorter than data.max_prompt_length \+ "
                                                 r"rollout.max_response_tokens=13"):
        NativeDecoder(model, max_seq_len=13)
    decoder = NativeDecoder(model, max_seq_len=8)
    short = ([3, 1, 4, 2], [5, 7, 4, 1])  # prompt + response <= 8
    _assert_same(_loss_and_grads(model, _padded(decoder), _batch(*short)),
                 _loss_and_grads(model, sequence_logprobs, _batch(*short)))
    for fn in (padded_native_logprobs, packed_native_logprobs):
        with pytest.raises(NativeForwardError, match=r"sliding_window=8 is shorter than the longest sample .*=13"):
            fn(decoder, model, *_batch(*BATCH))
