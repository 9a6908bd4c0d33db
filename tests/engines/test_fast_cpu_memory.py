"""FastRolloutEngine: a cache sized by the calls (not by max_batch x max_seq_len) and one prefill per distinct
prompt when a batch repeats prompts (GRPO's n samples), with outputs equal to prefilling every row."""
from __future__ import annotations

import torch

from fleetrl.engines.fast import FastRolloutEngine
from fleetrl.engines.protocol import SamplingParams
from tests.engines.test_fast import CharTokenizer, left_padded, tiny_model


def test_cache_is_sized_by_the_call_and_grows():
    model = tiny_model("llama")
    eng = FastRolloutEngine(model, CharTokenizer(None), device="cpu", max_batch=256, max_seq_len=2048)
    ids, mask = left_padded([3, 5, 4])
    eng.generate(ids, mask, SamplingParams(max_new_tokens=4, temperature=0.0))
    # 3 rows -> bucket 4 slots; 5 prompt + 4 new = 9 positions -> one granule of 64.
    assert (eng._buf.slots, eng._buf.seq_len) == (4, 64)
    # k and v: 2 layers x 4 slots x 2 kv heads x 64 positions x 16 head dim x 4 bytes = 65,536 bytes each
    assert eng._buf.k.numel() * 4 == 65_536
    ids, mask = left_padded([70, 2, 2, 2, 2])
    eng.generate(ids, mask, SamplingParams(max_new_tokens=4, temperature=0.0))
    assert (eng._buf.slots, eng._buf.seq_len) == (8, 128)  # 5 rows -> 8; 74 positions -> 128
    eng.generate(*left_padded([3]), SamplingParams(max_new_tokens=4, temperature=0.0))
    assert (eng._buf.slots, eng._buf.seq_len) == (8, 128)  # a smaller call reuses it
    eng.sleep()
    assert eng._buf is None


def test_repeated_prompts_prefill_once_and_sample_as_if_alone():
    model = tiny_model("qwen2")
    ids, mask = left_padded([4, 6], seed=3)
    n = 3
    grouped_ids, grouped_mask = ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0)  # GRPO layout
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=11)
    shared = FastRolloutEngine(model, CharTokenizer(None), device="cpu", max_seq_len=64)
    out = shared.generate(grouped_ids, grouped_mask, params)
    assert shared.stats["prefilled_prompts"] == 2  # 6 rows, 2 distinct prompts
    # max_batch=1 admits one row at a time, so nothing is shared: every row is prefilled itself.
    alone = FastRolloutEngine(model, CharTokenizer(None), device="cpu", max_seq_len=64, max_batch=1)
    ref = alone.generate(grouped_ids, grouped_mask, params)
    assert alone.stats["prefilled_prompts"] == 6
    assert torch.equal(out.responses, ref.responses)
    assert torch.allclose(out.logprobs, ref.logprobs, atol=1e-5)
    assert len({tuple(r.tolist()) for r in out.responses[:n]}) > 1  # the copies of one prompt still differ


def test_bf16_compute_on_an_fp32_model_equals_decoding_a_bf16_copy():
    import copy

    model = tiny_model("llama")
    ids, mask = left_padded([4, 6, 3], seed=5)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=2)
    cast = FastRolloutEngine(model, CharTokenizer(None), device="cpu", max_seq_len=64, compute_dtype=torch.bfloat16)
    out = cast.generate(ids, mask, params)
    bf16_model = copy.deepcopy(model).to(torch.bfloat16)
    ref = FastRolloutEngine(bf16_model, CharTokenizer(None), device="cpu", max_seq_len=64).generate(ids, mask, params)
    # Same tokens; logprobs differ by bf16 rounding only: `.to(bfloat16)` also rounds the copy's RoPE inv_freq,
    # while the engine builds its RoPE table from the fp32 model's.
    assert torch.equal(out.responses, ref.responses)
    torch.testing.assert_close(out.logprobs, ref.logprobs, atol=0.05, rtol=0)
    assert cast._fwd.shadow is None and cast._buf.k.dtype == torch.bfloat16  # the copy lives only during a call
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_compute_dtype_is_an_engine_argument():
    assert FastRolloutEngine(tiny_model("qwen2"), None, device="cpu", compute_dtype=torch.bfloat16).dtype == torch.bfloat16
    assert FastRolloutEngine(tiny_model("qwen2"), None, device="cpu").dtype == torch.float32


def test_batch_buckets_cover_max_batch_in_steps_of_64_above_128():
    from fleetrl.engines.fast.graphs import batch_buckets

    # powers of two to 128, then +64: 14 buckets (graphs per sampling mode) for max_batch 512
    assert batch_buckets(512) == [1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 320, 384, 448, 512]
    assert batch_buckets(300) == [1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 300]  # the last one is max_batch
    assert batch_buckets(100) == [1, 2, 4, 8, 16, 32, 64, 100] and batch_buckets(1) == [1]
    # a 300-row call gets 320 slots of cache, not 512
    eng = FastRolloutEngine(tiny_model("llama"), CharTokenizer(None), device="cpu", max_batch=512, max_seq_len=64)
    assert eng._ready(300, 8).slots == 320
