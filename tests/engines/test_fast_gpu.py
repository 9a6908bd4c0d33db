"""The fast engine's CUDA paths (CUDA graphs, Triton kernels, fused q/k/v and gate/up copies, per-sample limits)
against the CPU-tested torch paths, and the native training forward against HF, on a GPU (skipped on CPU).

fp32 with TF32 off, so greedy decoding of the tiny models is deterministic enough to compare token for token."""
from __future__ import annotations

import pytest
import torch

from fleetrl.engines.fast import FastRolloutEngine
from fleetrl.engines.protocol import SamplingParams
from tests.engines.test_fast import CharTokenizer, hf_greedy, left_padded, tiny_model, training_logprobs

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _exact_matmuls():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def _cuda_engine(model: torch.nn.Module, eos: int | None = None, **kw) -> FastRolloutEngine:
    return FastRolloutEngine(model.cuda(), CharTokenizer(eos), device="cuda", **{"max_seq_len": 64, **kw})


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("fuse", [True, False])
def test_graphs_and_kernels_decode_what_hf_decodes(arch: str, fuse: bool) -> None:
    ids, mask = left_padded([3, 9, 6, 1])
    model = tiny_model(arch)
    ref = hf_greedy(model, ids, mask, 12, None)
    eng = _cuda_engine(model, fuse_projections=fuse)
    assert eng.use_cuda_graphs
    out = eng.generate(ids.cuda(), mask.cuda(), SamplingParams(max_new_tokens=12, temperature=0.0))
    assert torch.equal(out.responses.cpu(), ref.cpu())


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("max_seq_len", [128, 400])
def test_each_attention_launch_decodes_what_hf_decodes(head_dim: int, max_seq_len: int) -> None:
    """The attention kernel's launch depends on the head dim (triton_kernels.ATTN_LAUNCH: the 0.5B's 64, the 1.5B's
    128) and, below ~2 programs per SM, splits the cache span (`attention_splits`): with a 300-token prompt the
    cache holds 384 positions, split over 2 programs of 192 and a merge kernel, and that slot reads both; with a
    70-token prompt, 128 positions and one program."""
    ids, mask = left_padded([300, 9, 140, 1] if max_seq_len > 256 else [70, 9, 40, 1])
    model = tiny_model("qwen2", hidden_size=4 * head_dim, num_attention_heads=4, max_position_embeddings=512)
    ref = hf_greedy(model, ids, mask, 24, None)
    eng = _cuda_engine(model, max_seq_len=max_seq_len)
    out = eng.generate(ids.cuda(), mask.cuda(), SamplingParams(max_new_tokens=24, temperature=0.0))
    assert eng.kernels.attention_splits(4, 2, eng._buf.seq_len)[0] == (2 if max_seq_len > 256 else 1)
    assert torch.equal(out.responses.cpu(), ref.cpu())


@pytest.mark.parametrize("fuse", [True, False])
def test_sampled_logprobs_match_the_training_forward_on_cuda(fuse: bool) -> None:
    model = tiny_model("qwen2")
    ids, mask = left_padded([4, 7, 2])
    eng = _cuda_engine(model, fuse_projections=fuse)
    out = eng.generate(ids.cuda(), mask.cuda(), SamplingParams(max_new_tokens=8, temperature=0.7, seed=3))
    ref = training_logprobs(model, ids.cuda(), mask.cuda(), out, 0.7)
    torch.testing.assert_close(out.logprobs, ref, atol=1e-4, rtol=0)


def test_per_sample_limits_with_graphs_keep_the_unlimited_prefix() -> None:
    ids, mask = left_padded([3, 9, 6, 1, 4, 5])
    limits = [1, 3, 7, 2, 5, 7]
    run = lambda lim: _cuda_engine(tiny_model("llama"), max_batch=4, sync_every=1).generate(  # noqa: E731
        ids.cuda(), mask.cuda(), SamplingParams(max_new_tokens=7, temperature=1.0, seed=11,
                                                max_new_tokens_per_sample=lim))
    free, limited = run(None), run(torch.tensor(limits))
    assert limited.response_mask.sum(1).tolist() == limits
    for i, n in enumerate(limits):
        assert torch.equal(limited.responses[i, :n], free.responses[i, :n]), f"sample {i}"


@pytest.mark.parametrize("sync_every", [1, 4])
def test_samples_of_a_prompt_read_its_rows_at_the_leader_until_it_stops(sync_every: int) -> None:
    """Followers read the prompt's cache rows at their group's leader slot (triton_kernels.decode_attention).
    Leaders stop first (limits 1-2) and, with 4 slots, their slots are refilled with other prompts while the
    followers still decode: a follower still reading there would go wrong against HF's greedy tokens. With
    sync_every=4 the live slots decode 2 steps after the sync that finds a leader stopped and before its slot is
    released (engine.py `_run`)."""
    ids, mask = left_padded([3, 9, 6])
    index = [0, 0, 0, 1, 1, 2, 2, 2]
    ids, mask = ids[index], mask[index]
    limits = torch.tensor([1, 7, 5, 2, 7, 1, 7, 6])
    model = tiny_model("llama")
    ref = hf_greedy(model, ids, mask, 7, None)
    eng = _cuda_engine(model, max_batch=4, sync_every=sync_every)
    out = eng.generate(ids.cuda(), mask.cuda(), SamplingParams(max_new_tokens=7, temperature=0.0,
                                                               max_new_tokens_per_sample=limits))
    for i, n in enumerate(limits.tolist()):
        assert torch.equal(out.responses[i, :n].cpu(), ref[i, :n].cpu()), f"sample {i}"


def _no_host_sync(fn):  # noqa: ANN001, ANN202
    """fn with CUDA's sync debug mode at "error": any call in it that waits for the GPU raises."""
    def wrapped(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        torch.cuda.set_sync_debug_mode("error")
        try:
            return fn(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return wrapped


def test_host_work_between_syncs_never_waits_for_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill, release, compaction and decode rounds are queued while the GPU still runs the steps before
    them (engine.py `_run`). A host wait in any of them serialises the engine: `done[index] = True` did, and cost
    ~20% of a long-tailed call on an H200 (bench/RESULTS.md, tenth round). Groups of 3 with mixed limits in 4 slots
    take every path: refills, followers, leaders released first, the tail compacted."""
    from fleetrl.engines.fast.state import SlotBuffers

    ids, mask = left_padded([3, 9, 6, 4])
    index = [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    ids, mask = ids[index].cuda(), mask[index].cuda()
    limits = torch.tensor([1, 9, 5, 2, 12, 3, 1, 7, 12, 4, 2, 10])
    eng = _cuda_engine(tiny_model("qwen2"), max_batch=4, sync_every=4)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=5, max_new_tokens_per_sample=limits)
    ref = eng.generate(ids, mask, params)  # captures the graphs of every bucket this call reaches
    before = dict(eng.stats)  # the stats add up over calls: the checked call's own work is the difference
    for name in ("_prefill", "_compact", "_decode_round"):
        monkeypatch.setattr(eng, name, _no_host_sync(getattr(eng, name)))
    monkeypatch.setattr(SlotBuffers, "release", _no_host_sync(SlotBuffers.release))
    out = eng.generate(ids, mask, params)
    assert eng.stats["moved_slots"] > before["moved_slots"] and eng.stats["prefills"] > before["prefills"] + 1
    assert torch.equal(out.responses, ref.responses) and out.response_mask.sum(1).tolist() == limits.tolist()


def test_fused_copies_follow_new_weights_on_cuda() -> None:
    ids, mask = left_padded([5, 8])
    params = SamplingParams(max_new_tokens=10, temperature=0.0)
    eng = _cuda_engine(tiny_model("qwen2"), fuse_projections=True)
    eng.generate(ids.cuda(), mask.cuda(), params)  # graphs captured on the old weights
    torch.manual_seed(5)
    new = {k: torch.randn_like(v) * 0.05 for k, v in tiny_model("qwen2").cuda().state_dict().items()
           if k.endswith("proj.weight")}
    eng.load_weights(new, version=1)
    fresh_model = tiny_model("qwen2").cuda()
    fresh_model.load_state_dict(new, strict=False)
    expected = _cuda_engine(fresh_model, fuse_projections=True).generate(ids.cuda(), mask.cuda(), params)
    assert torch.equal(eng.generate(ids.cuda(), mask.cuda(), params).responses, expected.responses)
