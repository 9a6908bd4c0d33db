"""FastRolloutEngine tensor parallel (engines/fast/tp.py) on CPU fp32 over gloo: two processes, each with the whole
tiny model, run one TP=2 engine beside a plain TP=1 engine on the same model, and must agree with it: the same greedy
and sampled tokens (continuous batching, shared-prompt prefill, per-sample limits, stop strings), log-probs within
1e-5, and the same change after an optimiser step once the engines are told the version moved; fused projections are
built from the shards and LoRA merges sliced after merging; Qwen3 with biases checks that the row-parallel o bias is
added once. The refusals: a shape k does not divide, and ranks called with
different prompts. Each slow test spawns two processes: ~13 s on 2 cores, ~85 s for the module."""
from __future__ import annotations

import socket
from datetime import timedelta
from typing import Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fleetrl.engines.fast import FastRolloutEngine
from fleetrl.engines.fast.arch import DecoderSpec
from fleetrl.engines.fast.tp import check_shape, local_spec
from fleetrl.engines.protocol import FINISH_LENGTH, FINISH_STOP, SamplingParams
from tests.engines.test_fast import CharTokenizer, left_padded, tiny_model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable[..., None], port: int, args: tuple) -> None:
    torch.set_num_threads(1)  # two ranks on a 2-core box; also keeps every reduction's order fixed
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))  # a collective one rank never joins fails, not hangs
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()


def _on_two_ranks(fn: Callable[..., None], *args: object) -> None:
    """fn(rank, *args) in two spawned processes joined in one gloo group; a failure on either rank fails the test."""
    mp.spawn(_entry, args=(fn, _free_port(), args), nprocs=2, join=True)


def _engines(model: torch.nn.Module, eos: int | None, **kw) -> tuple[FastRolloutEngine, FastRolloutEngine]:
    """(TP=1 engine, TP=2 engine over the default group) on the same model."""
    common = {"device": "cpu", "max_seq_len": 64, "max_batch": 4, "sync_every": 3, **kw}
    return (FastRolloutEngine(model, CharTokenizer(eos), **common),
            FastRolloutEngine(model, CharTokenizer(eos), tp_group=dist.group.WORLD, **common))


def _same(a, b) -> None:
    assert torch.equal(a.responses, b.responses), (a.responses, b.responses)
    assert torch.equal(a.response_mask, b.response_mask) and a.finish_reasons == b.finish_reasons
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


def _calls(eos: int) -> list[SamplingParams]:
    limits = torch.tensor([3, 10, 7, 10, 1, 10, 5, 10])
    return [SamplingParams(max_new_tokens=10, temperature=0.0),
            SamplingParams(max_new_tokens=10, temperature=0.8, seed=5),
            SamplingParams(max_new_tokens=10, temperature=1.2, top_k=8, top_p=0.9, seed=6),
            SamplingParams(max_new_tokens=10, temperature=1.0, seed=7, max_new_tokens_per_sample=limits,
                           stop_strings=(CharTokenizer(None).decode([eos + 1]),), stop_token_ids=(eos,))]


def _check_equals_one_rank(rank: int, arch: str, fuse: bool, lora: bool) -> None:
    if arch == "qwen3_bias_tied":  # o_proj biases (added once, after the all-reduce), q/k norms, a tied head
        from tests.engines.test_fast_families import family_model

        model = family_model(arch)
    else:
        model = tiny_model(arch)  # seeded: the same weights on both ranks
    if lora:  # merged on the whole weight, then sliced
        from fleetrl.config.schema import LoraConfig
        from fleetrl.models.lora import apply_lora

        apply_lora(model, LoraConfig(rank=4, alpha=8.0))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:  # B starts at 0: make the adapters count
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    one, tp = _engines(model, None, fuse_projections=fuse)
    assert tp.local_spec.num_heads == 2 and tp.local_spec.num_kv_heads == 1 and tp.spec.num_heads == 4
    ids, mask = left_padded([5, 2, 8, 8])
    ids, mask = ids.repeat_interleave(2, 0), mask.repeat_interleave(2, 0)  # n = 2 samples: shared-prompt prefill
    before = []
    for params in _calls(eos=7):
        a, b = one.generate(ids, mask, params), tp.generate(ids, mask, params)
        _same(a, b)
        before.append(b)
    assert tp._buf.k.shape[2] == 1 and one._buf.k.shape[2] == 2, "each rank caches its own KV head"
    assert tp.stats["prefilled_prompts"] < 4 * len(ids) and tp.stats["moved_slots"] > 0
    assert FINISH_STOP in before[-1].finish_reasons and FINISH_LENGTH in before[-1].finish_reasons
    # An optimiser step on the shared model (identical on both ranks), then the versions move, as a sync does.
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    logits = model(torch.cat([ids, before[1].responses], 1)).logits
    (-torch.log_softmax(logits.float(), -1)[..., 3].mean()).backward()
    opt.step()
    one.weights_version = tp.weights_version = 1
    for params, old in zip(_calls(eos=7), before):
        a, b = one.generate(ids, mask, params), tp.generate(ids, mask, params)
        _same(a, b)
        assert not torch.allclose(b.logprobs, old.logprobs, atol=1e-3), "the TP engine decodes the new weights"
    out = [torch.empty_like(b.responses) for _ in range(2)]
    dist.all_gather(out, b.responses)
    assert torch.equal(out[0], out[1]), "both ranks return the same tokens"


@pytest.mark.slow
@pytest.mark.parametrize("arch,fuse,lora", [("llama", False, False), ("qwen2", True, False), ("llama", False, True),
                                            ("qwen3_bias_tied", True, False)])
def test_tp2_equals_tp1(arch: str, fuse: bool, lora: bool) -> None:
    _on_two_ranks(_check_equals_one_rank, arch, fuse, lora)


def _check_compute_dtype(rank: int) -> None:
    """bf16 decode of the fp32 model from shard copies: cast per call (CPU's default) and kept at fixed addresses
    (keep_cast, what CUDA graphs read), refreshed after a weight change. Rounding differs from TP=1's (each rank's
    partial product is rounded to bf16 before the sum), so log-probs are held to 0.05, as other bf16 tests are."""
    model = tiny_model("qwen2")
    ids, mask = left_padded([5, 2, 8])
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=3)
    for keep in (False, True):
        one, tp = _engines(model, None, compute_dtype=torch.bfloat16, keep_cast=keep)
        seen = []
        for version in (0, 1):
            if version:
                with torch.no_grad():  # in place, then the version moves
                    for p in model.parameters():
                        p.mul_(1.5)
                one.weights_version = tp.weights_version = version
            a, b = one.generate(ids, mask, params), tp.generate(ids, mask, params)
            first = a.responses[:, 0] == b.responses[:, 0]
            assert first.all(), (a.responses, b.responses)
            torch.testing.assert_close(a.logprobs[:, 0], b.logprobs[:, 0], atol=0.05, rtol=0)
            seen.append(b.logprobs[:, 0])
        assert (seen[0] - seen[1]).abs().max() > 0.1, "the TP engine's bf16 copy follows the new weights"
        assert (tp._fwd.cast is not None) == keep


@pytest.mark.slow
def test_compute_dtype_copies_are_sharded() -> None:
    _on_two_ranks(_check_compute_dtype)


def _check_refusals(rank: int) -> None:
    with pytest.raises(ValueError, match=r"num_kv_heads=1 not divisible by the tensor-parallel degree 2 .*"
                                         r"degrees that divide this model: 1$"):
        _engines(tiny_model("llama", num_key_value_heads=1), None)
    _, tp = _engines(tiny_model("llama"), None)
    ids, mask = left_padded([3, 4], seed=1 + rank)  # each rank its own prompts
    with pytest.raises(RuntimeError, match=f"rank {rank} of 2: the prompts, prompt masks and token limits differ"):
        tp.generate(ids, mask, SamplingParams(max_new_tokens=4, temperature=0.0))
    ids, mask = left_padded([3, 4])
    out = tp.generate(ids, mask, SamplingParams(max_new_tokens=4, temperature=0.0))  # the group is still usable
    assert out.response_mask.all()


@pytest.mark.slow
def test_refusals() -> None:
    _on_two_ranks(_check_refusals)


def test_local_spec_and_the_divisibility_message() -> None:
    spec = DecoderSpec(num_layers=2, hidden=896, num_heads=14, num_kv_heads=2, head_dim=64, vocab=10, rms_eps=1e-6)
    half = local_spec(spec, 2)
    assert (half.num_heads, half.num_kv_heads, half.group, half.hidden) == (7, 1, 7, 896)
    check_shape(spec, 4864, 2)
    with pytest.raises(ValueError, match=r"num_heads=14 and num_kv_heads=2 not divisible by the tensor-parallel "
                                         r"degree 4 .*: 1, 2$"):
        check_shape(spec, 4864, 4)
