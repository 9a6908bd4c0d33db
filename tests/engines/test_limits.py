"""Per-sample response limits (SamplingParams.max_new_tokens_per_sample) on both engines, CPU fp32: each sample
stops at its own limit with finish_reason "length", and its tokens are the unlimited call's (same seed)."""
from __future__ import annotations

import pytest
import torch

from fleetrl.engines.hf import HFRolloutEngine
from fleetrl.engines.protocol import FINISH_LENGTH, SamplingParams, response_limits
from fleetrl.models.tiny import build_tiny_model, build_tiny_tokenizer
from tests.engines.test_fast import engine, left_padded, tiny_model

LIMITS = [1, 3, 7, 2, 5, 7]


def _params(limits: list[int] | None, max_new: int = 7) -> SamplingParams:
    per_sample = None if limits is None else torch.tensor(limits)
    return SamplingParams(max_new_tokens=max_new, temperature=1.0, seed=11, max_new_tokens_per_sample=per_sample)


def test_fast_engine_stops_each_slot_at_its_limit_and_refills_it():
    ids, mask = left_padded([3, 9, 6, 1, 4, 5])
    # 4 slots for 6 prompts: the two last wait, and are admitted as soon as a slot frees (sync every step)
    free_run = engine(tiny_model("llama"), None, max_batch=4, sync_every=1)
    unlimited = free_run.generate(ids, mask, _params(None))
    limited_run = engine(tiny_model("llama"), None, max_batch=4, sync_every=1)
    limited = limited_run.generate(ids, mask, _params(LIMITS))
    assert unlimited.response_mask.sum(1).tolist() == [7] * 6  # no EOS: every sample runs to max_new_tokens
    assert limited.response_mask.sum(1).tolist() == LIMITS
    assert limited.finish_reasons == [FINISH_LENGTH] * 6
    for i, n in enumerate(LIMITS):
        assert torch.equal(limited.responses[i, :n], unlimited.responses[i, :n]), f"sample {i}"
        torch.testing.assert_close(limited.logprobs[i, :n], unlimited.logprobs[i, :n], rtol=1e-5, atol=1e-5)
    # Each token after a slot's prefill token is one decode step. Unlimited: prompts 0-3 take 6 steps, then prompts
    # 4-5 another 6: 12. Limited: prompt 0 (limit 1) is done at its prefill and prompt 3 (limit 2) after step 1,
    # so prompts 4-5 are admitted after step 1; prompt 5 (limit 7) then needs 6 more steps: 1 + 6 = 7.
    assert (limited_run.stats["decode_steps"], free_run.stats["decode_steps"]) == (7, 12)


def test_fast_engine_moves_a_long_tail_into_a_small_decode_batch():
    ids, mask = left_padded([3, 9, 6, 1, 4, 5, 2, 7])
    limits = [1, 2, 1, 3, 1, 1, 2, 7]  # slot 7 outlives the rest: without moving it every step computes 8 slots
    free_run = engine(tiny_model("qwen2"), None, max_batch=8, sync_every=1)
    unlimited = free_run.generate(ids, mask, _params(None))
    eng = engine(tiny_model("qwen2"), None, max_batch=8, sync_every=1)
    limited = eng.generate(ids, mask, _params(limits))
    assert limited.response_mask.sum(1).tolist() == limits
    for i, n in enumerate(limits):
        assert torch.equal(limited.responses[i, :n], unlimited.responses[i, :n]), f"sample {i}"
        torch.testing.assert_close(limited.logprobs[i, :n], unlimited.logprobs[i, :n], rtol=1e-5, atol=1e-5)
    # Step 1 decodes all 8 slots (the host learns which ended only at the sync after it). It ends limits 1 and 2:
    # samples 3 (slot 3, 2 of 3 tokens) and 7 (slot 7) live on, bucket 2, so they move to slots 0 and 1. Step 2
    # ends sample 3; sample 7 alone needs bucket 1 and moves to slot 0 for its remaining 4 steps (7 tokens = 6
    # steps). Rows: 8 + 2 + 4 = 14 with 3 moves, against 6 steps x 8 = 48 unmoved.
    assert eng.stats["decode_steps"] == 6 and eng.stats["decode_rows"] == 14 and eng.stats["moved_slots"] == 3
    assert free_run.stats["decode_rows"] == 6 * 8 and free_run.stats["moved_slots"] == 0


def test_hf_engine_cuts_each_sample_at_its_limit():
    tok = build_tiny_tokenizer()
    texts = [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=False)
             for c in ("copy a b c", "add 1 2", "copy d")]
    enc = tok(texts, padding=True, return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    unlimited = HFRolloutEngine(build_tiny_model(tok), tok).generate(ids, mask, _params(None, max_new=6))
    limited = HFRolloutEngine(build_tiny_model(tok), tok).generate(ids, mask, _params([2, 6, 4], max_new=6))
    free_len = unlimited.response_mask.sum(1).tolist()
    assert any(n < f for n, f in zip([2, 6, 4], free_len)), f"no limit cut anything (free lengths {free_len})"
    for i, n in enumerate([2, 6, 4]):
        keep = min(n, free_len[i])  # an EOS before the limit ends the sample as in the unlimited call
        assert int(limited.response_mask[i].sum()) == keep
        assert torch.equal(limited.responses[i, :keep], unlimited.responses[i, :keep])
        torch.testing.assert_close(limited.logprobs[i, :keep], unlimited.logprobs[i, :keep])
        assert limited.finish_reasons[i] == (FINISH_LENGTH if n < free_len[i] else unlimited.finish_reasons[i])


@pytest.mark.parametrize("limits, message", [
    (torch.tensor([0, 3]), r"max_new_tokens_per_sample\[0\] = 0 is outside 1..max_new_tokens=7 \(1 of 2"),
    (torch.tensor([3, 8]), r"max_new_tokens_per_sample\[1\] = 8 is outside 1..max_new_tokens=7"),
    (torch.tensor([3, 3, 3]), r"max_new_tokens_per_sample must be an integer tensor of shape \[2\].*\(3,\)"),
    (torch.tensor([3.0, 3.0]), r"max_new_tokens_per_sample must be an integer tensor.*torch.float32"),
])
def test_bad_limits_name_the_field(limits, message):
    with pytest.raises(ValueError, match=message):
        response_limits(SamplingParams(max_new_tokens=7, max_new_tokens_per_sample=limits), 2)
    ids, mask = left_padded([3, 5])
    with pytest.raises(ValueError, match=message):  # the engine checks before it decodes
        engine(tiny_model("qwen2"), None).generate(ids, mask, SamplingParams(max_new_tokens=7,
                                                                             max_new_tokens_per_sample=limits))
