"""FastRolloutEngine with a compute dtype other than the model's, its copy kept at fixed addresses (engines/fast/cast.py):
what CUDA graphs read for fp32 master weights with a bf16 decode. On CPU the copy is forced with keep_cast=True (no
graphs), which runs the same code as on a GPU: allocated once, refreshed in place where the engine learns the
weights changed, decoding exactly what a copy cast per call decodes. The GPU test at the end runs it under graphs."""
from __future__ import annotations

import copy

import pytest
import torch

from fleetrl.engines.fast import FastRolloutEngine
from fleetrl.engines.protocol import SamplingParams
from tests.engines.test_fast import CharTokenizer, left_padded, tiny_model

BF16 = torch.bfloat16
SAMPLED = SamplingParams(max_new_tokens=8, temperature=1.0, seed=2)


def _engine(model: torch.nn.Module, device: str = "cpu", **kw) -> FastRolloutEngine:
    return FastRolloutEngine(model, CharTokenizer(None), device=device, max_seq_len=64, compute_dtype=BF16, **kw)


def _perturb(model: torch.nn.Module) -> None:
    """What an optimizer step does to the colocated engine's weights: new values in the same tensors."""
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)).to(p) * 0.3)


def _ptrs(eng: FastRolloutEngine) -> list[int]:
    w = eng._fwd.shadow
    return [t.data_ptr() for t in w.tensors()]


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_kept_copy_decodes_exactly_what_a_copy_per_call_decodes(arch: str, fuse: bool) -> None:
    model = tiny_model(arch)
    ids, mask = left_padded([4, 6, 3], seed=5)
    kept, per_call = _engine(model, keep_cast=True, fuse_projections=fuse), _engine(model, fuse_projections=fuse)
    assert kept.keep_cast and not per_call.keep_cast  # CPU default: a copy per call
    a, b = kept.generate(ids, mask, SAMPLED), per_call.generate(ids, mask, SAMPLED)
    assert torch.equal(a.responses, b.responses) and torch.equal(a.logprobs, b.logprobs)
    assert per_call._fwd.shadow is None  # freed at the end of its call
    assert kept._fwd.shadow is not None and {t.dtype for t in kept._fwd.shadow.tensors()} == {BF16}  # kept
    assert {p.dtype for p in model.parameters()} == {torch.float32}


@pytest.mark.parametrize("fuse", [False, True])
def test_the_kept_copy_is_refreshed_in_place_when_the_version_is_assigned(fuse: bool) -> None:
    model = tiny_model("qwen2")
    ids, mask = left_padded([5, 3, 7], seed=2)
    eng = _engine(model, keep_cast=True, fuse_projections=fuse)
    before = eng.generate(ids, mask, SAMPLED)
    ptrs = _ptrs(eng)
    wo = eng._fwd.shadow.layers[1].wo
    _perturb(model)
    # Not told: the copy still holds the old weights (a caller that changes weights assigns weights_version).
    assert torch.equal(eng.generate(ids, mask, SAMPLED).logprobs, before.logprobs)
    eng.weights_version = 1  # the colocated trainer's sync
    after = eng.generate(ids, mask, SAMPLED)
    assert _ptrs(eng) == ptrs  # the same memory: graphs captured on it stay valid
    assert torch.equal(wo, model.model.layers[1].self_attn.o_proj.weight.detach().to(BF16))  # new values
    fresh = _engine(copy.deepcopy(model), fuse_projections=fuse).generate(ids, mask, SAMPLED)
    assert torch.equal(after.responses, fresh.responses) and torch.equal(after.logprobs, fresh.logprobs)
    assert not torch.equal(after.logprobs, before.logprobs)


def test_load_weights_refreshes_the_kept_copy() -> None:
    model = tiny_model("llama")
    ids, mask = left_padded([4, 6], seed=3)
    eng = _engine(model, keep_cast=True)
    eng.generate(ids, mask, SAMPLED)
    ptrs = _ptrs(eng)
    other = tiny_model("llama")
    _perturb(other)
    eng.load_weights(dict(other.named_parameters()), version=7)
    got = eng.generate(ids, mask, SAMPLED)
    assert _ptrs(eng) == ptrs and eng.weights_version == 7
    want = _engine(other).generate(ids, mask, SAMPLED)
    assert torch.equal(got.responses, want.responses) and torch.equal(got.logprobs, want.logprobs)


def test_a_tied_embedding_is_one_buffer_and_fused_projections_are_not_copied_twice() -> None:
    model = tiny_model("qwen2", tie_word_embeddings=True)
    ids, mask = left_padded([4, 2], seed=1)
    plain, fused = _engine(model, keep_cast=True), _engine(model, keep_cast=True, fuse_projections=True)
    a, b = plain.generate(ids, mask, SAMPLED), fused.generate(ids, mask, SAMPLED)
    assert torch.equal(a.responses, b.responses)
    w = plain._fwd.shadow
    assert w.embed.data_ptr() == w.lm_head.data_ptr()
    # bf16 bytes: every parameter once (the tied head is the embedding), biases included
    assert plain._fwd.cast.nbytes() == 2 * sum(p.numel() for p in model.parameters())
    # with fused projections q/k/v and gate/up live in the fused bf16 buffers alone; the copy holds the rest
    lw = fused._fwd.shadow.layers[0]
    assert lw.wq.data_ptr() == lw.wqkv.data_ptr() and lw.wqkv.dtype == BF16
    projections = sum(p.numel() for n, p in model.named_parameters()
                      if any(k in n for k in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")))
    assert fused._fwd.cast.nbytes() == plain._fwd.cast.nbytes() - 2 * projections


def test_sleep_frees_the_kept_copy_and_the_next_call_makes_it_again() -> None:
    model = tiny_model("llama")
    ids, mask = left_padded([3, 5], seed=4)
    eng = _engine(model, keep_cast=True)
    first = eng.generate(ids, mask, SAMPLED)
    eng.sleep()
    assert eng._fwd.cast.nbytes() == 0 and eng._fwd.shadow is None
    again = eng.generate(ids, mask, SAMPLED)
    assert torch.equal(first.logprobs, again.logprobs) and eng._fwd.cast.nbytes() > 0


def test_lora_merges_are_kept_in_the_compute_dtype_and_follow_each_step() -> None:
    # A LoRA actor's merges change at every call without any sync (the adapters train); with a kept copy they are
    # rounded to bf16 into fixed buffers, which the decode reads as they are.
    from tests.models.test_lora import PROMPT_MASK, PROMPTS, _logp, _trained

    model, _, trainer = _trained(targets=("all-linear",))
    kept = _engine(model, keep_cast=True, max_batch=4)
    for step in range(2):
        per_call = _engine(model, max_batch=4)
        a, b = kept.generate(PROMPTS, PROMPT_MASK, SAMPLED), per_call.generate(PROMPTS, PROMPT_MASK, SAMPLED)
        assert torch.equal(a.responses, b.responses) and torch.equal(a.logprobs, b.logprobs), f"step {step}"
        merged = kept._fwd.merged.layers[0].wq
        assert merged.dtype == BF16 and kept._fwd.shadow.layers[0].wq.data_ptr() == merged.data_ptr()
        if step == 0:
            address = merged.data_ptr()
        assert merged.data_ptr() == address  # merged into the same buffers at every call
        trainer.step(iter([None]), lambda _: (-_logp(model).mean(), {}))


@pytest.mark.gpu
@pytest.mark.parametrize("fuse", [True, False])
def test_fp32_model_decodes_in_bf16_under_cuda_graphs_and_follows_new_weights(fuse: bool) -> None:
    """fp32 master weights, bf16 decode with CUDA graphs (rollout.compute_dtype: auto on a GPU): the graphs are
    captured on the kept bf16 copy, which the version bump refreshes in place, so the replayed graphs decode the
    new weights; the result equals a fresh engine's on them."""
    model = tiny_model("qwen2").cuda()
    ids, mask = (t.cuda() for t in left_padded([5, 8, 3], seed=6))
    eng = _engine(model, "cuda", fuse_projections=fuse)
    assert eng.use_cuda_graphs and eng.keep_cast and eng.dtype == BF16
    before = eng.generate(ids, mask, SAMPLED)
    graphs, ptrs = len(eng._graphs), _ptrs(eng)
    assert graphs > 0
    _perturb(model)
    eng.weights_version = 1
    after = eng.generate(ids, mask, SAMPLED)
    assert eng._graphs is not None and len(eng._graphs) == graphs  # replayed, not re-captured
    assert _ptrs(eng) == ptrs
    fresh = _engine(copy.deepcopy(model), "cuda", fuse_projections=fuse).generate(ids, mask, SAMPLED)
    assert torch.equal(after.responses, fresh.responses)
    torch.testing.assert_close(after.logprobs, fresh.logprobs, atol=1e-3, rtol=0)
    assert not torch.equal(after.responses, before.responses) or not torch.equal(after.logprobs, before.logprobs)
    # a copy cast per call cannot run under graphs: refused, with the way out
    with pytest.raises(ValueError, match="keep_cast=None or True"):
        _engine(model, "cuda", keep_cast=False)
