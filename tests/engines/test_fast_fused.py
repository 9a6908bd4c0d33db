"""FastRolloutEngine with fused q/k/v and gate/up copies (engines/fast/fused.py) on CPU fp32: the same decode as
reading the projections separately, and the copies follow every weight change the engine is told about."""
from __future__ import annotations

import copy

import pytest
import torch

from fleetrl.engines.fast import FastRolloutEngine
from fleetrl.engines.fast.fused import fused_nbytes
from fleetrl.engines.protocol import SamplingParams
from tests.engines.test_fast import SHAPE, CharTokenizer, left_padded, tiny_model

GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0)
SAMPLED = SamplingParams(max_new_tokens=10, temperature=1.0, seed=7)


def make(model: torch.nn.Module, fuse: bool, **kw) -> FastRolloutEngine:
    return FastRolloutEngine(model, CharTokenizer(None), device="cpu", max_seq_len=64, fuse_projections=fuse, **kw)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fused_decode_equals_separate_projections(arch: str) -> None:
    model = tiny_model(arch)
    ids, mask = left_padded([3, 9, 6, 1])
    fused, plain = make(model, True), make(model, False)
    for params in (GREEDY, SAMPLED):
        a, b = fused.generate(ids, mask, params), plain.generate(ids, mask, params)
        assert torch.equal(a.responses, b.responses)
        # one GEMM over the concatenated rows may sum in another order than three: fp32 rounding only
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    assert fused._fwd.fused.nbytes() > 0 and plain._fwd.fused is None


def test_fused_forward_logits_match_within_fp32_rounding() -> None:
    model = tiny_model("qwen2")
    fused, plain = make(model, True), make(model, False)
    fused._fwd.refresh_fused()
    tokens = torch.tensor([[5, 9, 2, 7, 11, 3]])
    logits = []
    for eng in (fused, plain):
        k = torch.zeros(2, 1, 2, 16, 16)
        v = torch.zeros_like(k)
        pre = eng._fwd.prefill(k, v, tokens, torch.tensor([6]), torch.tensor([0]))
        step = eng._fwd.decode(k, v, torch.tensor([4]), torch.tensor([6]), 16)
        logits.append(torch.cat([pre, step]))
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=1e-5)


def test_folded_norms_are_the_norm_weights_times_the_columns() -> None:
    """fold_norms (the Triton decode's setting): wqkv = cat(wq, wk, wv) · diag(ln1), wgu = cat(wg, wu) · diag(ln2),
    biases unscaled, ln1/ln2 None in the attached weights; a prefill through the folded views gives the plain
    logits, since g ⊙ norm(x) · Wᵀ = norm(x) · (W · diag(g))ᵀ. The Triton side is checked by
    triton_sampling_check.py (interpreter, CPU) and test_fast_gpu.py."""
    from fleetrl.engines.fast.arch import model_weights
    from fleetrl.engines.fast.forward import DecoderForward

    model = tiny_model("qwen2")
    plain = model_weights(model)
    fwd = DecoderForward(model, make(model, False).spec, 16, torch.float32, torch.device("cpu"), kernels=None,
                         fuse=True)
    fwd.fused.fold_norms = True
    fwd.refresh_fused()
    lw, ref = fwd.weights().layers[1], plain.layers[1]
    assert lw.ln1 is None and lw.ln2 is None
    torch.testing.assert_close(lw.wqkv, torch.cat([ref.wq, ref.wk, ref.wv]) * ref.ln1[None, :], rtol=0, atol=0)
    torch.testing.assert_close(lw.wgu, torch.cat([ref.wg, ref.wu]) * ref.ln2[None, :], rtol=0, atol=0)
    torch.testing.assert_close(lw.bqkv, torch.cat([ref.bq, ref.bk, ref.bv]), rtol=0, atol=0)
    assert float((ref.ln1 - 1).abs().max()) > 0.1  # tiny_model draws the norm weights: the fold is not a no-op
    tokens, logits = torch.tensor([[5, 9, 2, 7, 11, 3]]), []
    for f in (fwd, DecoderForward(model, fwd.spec, 16, torch.float32, torch.device("cpu"), kernels=None)):
        k = torch.zeros(2, 1, 2, 16, 16)
        logits.append(f.prefill(k, torch.zeros_like(k), tokens, torch.tensor([6]), torch.tensor([0])))
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=1e-5)


def test_memory_cost_formula() -> None:
    # tiny Qwen2: 2 layers, hidden 64, 4 heads x 16, 2 kv heads x 16, intermediate 128.
    # q + 2 kv = 64 + 2 x 32 = 128 rows; gate + up = 256 rows; (128 + 256) x 64 = 24,576 weights + 128 q/k/v
    # biases = 24,704 per layer; x 2 layers x 4 bytes = 197,632 bytes.
    eng = make(tiny_model("qwen2"), True)
    eng.generate(*left_padded([3]), SamplingParams(max_new_tokens=2, temperature=0.0))
    assert eng._fwd.fused.nbytes() == 197_632
    assert fused_nbytes(eng.spec, SHAPE["intermediate_size"], 4, qkv_bias=True) == 197_632
    # Qwen2.5-0.5B in bf16: 24 x (896 x (896 + 256 + 9,728) + 1,152) x 2 bytes = 467,982,336 bytes (module doc)
    spec = type(eng.spec)(num_layers=24, hidden=896, num_heads=14, num_kv_heads=2, head_dim=64, vocab=151936,
                          rms_eps=1e-6)
    assert fused_nbytes(spec, 4864, 2, qkv_bias=True) == 467_982_336


def test_load_weights_refreshes_the_fused_copies() -> None:
    model = tiny_model("qwen2")
    ids, mask = left_padded([4, 6, 2])
    eng = make(model, True)
    before = eng.generate(ids, mask, SAMPLED)
    address = eng._fwd.weights().layers[1].wqkv.data_ptr()
    g = torch.Generator().manual_seed(3)
    new = {name: torch.randn(p.shape, generator=g) * 0.2 for name, p in model.named_parameters()
           if any(part in name for part in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))}
    eng.load_weights(new, version=3)
    after = eng.generate(ids, mask, SAMPLED)
    assert eng._fwd.weights().layers[1].wqkv.data_ptr() == address  # refreshed in place: graphs stay valid
    eng.sleep()  # frees the copies; the next call makes them again
    assert eng._fwd.fused.nbytes() == 0
    assert torch.equal(eng.generate(ids, mask, SAMPLED).logprobs, after.logprobs)
    fresh = make(copy.deepcopy(model), True).generate(ids, mask, SAMPLED)  # model now holds the new values
    assert torch.equal(after.responses, fresh.responses) and torch.equal(after.logprobs, fresh.logprobs)
    assert not torch.equal(after.logprobs, before.logprobs)


def test_colocated_sync_refreshes_the_fused_copies() -> None:
    # The trainer's optimizer changes the parameters in place, then its sync assigns weights_version
    # (workers/worker.py:mark_weights_version): that is where the engine refreshes its copies.
    model = tiny_model("llama")
    ids, mask = left_padded([5, 3])
    eng = make(model, True)
    eng.generate(ids, mask, GREEDY)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(-2.0)
            layer.mlp.up_proj.weight.mul_(-1.0)
    eng.weights_version = 1
    want = make(copy.deepcopy(model), False).generate(ids, mask, SAMPLED)
    got = eng.generate(ids, mask, SAMPLED)
    assert torch.equal(got.responses, want.responses)
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=0)


def test_bf16_compute_with_fused_projections_keeps_no_unfused_copy() -> None:
    model = tiny_model("llama")
    ids, mask = left_padded([4, 6, 3], seed=5)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=2)
    a = make(model, True, compute_dtype=torch.bfloat16)
    b = make(model, False, compute_dtype=torch.bfloat16)
    assert torch.equal(a.generate(ids, mask, params).responses, b.generate(ids, mask, params).responses)
    a._fwd.cast_for_call(torch.bfloat16)
    lw = a._fwd.shadow.layers[0]
    # wq/wk/wv are views of the one fused bf16 matrix, not copies beside it
    assert lw.wqkv.dtype == torch.bfloat16 and lw.wq.data_ptr() == lw.wqkv.data_ptr()
    assert lw.wk.data_ptr() == lw.wqkv[lw.wq.shape[0]:].data_ptr()


def test_lora_merges_reach_the_fused_copies_every_call() -> None:
    from tests.models.test_lora import PROMPT_MASK, PROMPTS, _logp, _trained

    model, _, trainer = _trained(targets=("all-linear",))
    fused, plain = make(model, True, max_batch=4), make(model, False, max_batch=4)
    for _ in range(2):  # the second round: an optimizer step on the adapters, no sync call at all
        a, b = fused.generate(PROMPTS, PROMPT_MASK, SAMPLED), plain.generate(PROMPTS, PROMPT_MASK, SAMPLED)
        assert torch.equal(a.responses, b.responses)
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
        trainer.step(iter([None]), lambda _: (-_logp(model).mean(), {}))
