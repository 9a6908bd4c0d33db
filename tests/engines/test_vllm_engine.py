"""The `vllm` engine with the real vLLM (CPU build), fp32 tiny Llama/Qwen2: the same tokens, masks and finish
reasons as the hf reference engine, and the protocol's log-probs (plain log softmax(logits / T) at each sampled id,
what the trainer's forward computes)."""
from __future__ import annotations

import pytest
import torch

from fleetrl.engines.hf import HFRolloutEngine
from fleetrl.engines.protocol import FINISH_LENGTH, FINISH_STOP, RolloutEngine, SamplingParams
from tests.engines.vllm_helpers import TEXTS, prompts, tiny, trainer_logprobs

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request):
    from fleetrl.engines.vllm import VLLMRolloutEngine

    model, tok = tiny(request.param)
    engine = VLLMRolloutEngine(model, tok, max_batch=16, max_seq_len=128, seed=0)
    return model, tok, engine, HFRolloutEngine(model, tok)


def test_is_a_rollout_engine_and_its_first_sync_matches_the_trainer(setup):
    model, tok, engine, _ = setup
    assert isinstance(engine, RolloutEngine) and engine.weights_version == 0
    assert engine.baseline_gap is not None and engine.baseline_gap < 1e-4  # fp32: rounding only


def test_greedy_tokens_masks_and_logprobs_equal_hf(setup):
    model, tok, engine, hf = setup
    ids, mask = prompts(tok, TEXTS)
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    ours, ref = engine.generate(ids, mask, params), hf.generate(ids, mask, params)
    assert torch.equal(ours.responses, ref.responses)
    assert torch.equal(ours.response_mask, ref.response_mask)
    assert ours.finish_reasons == ref.finish_reasons
    torch.testing.assert_close(ours.logprobs, ref.logprobs, atol=1e-4, rtol=0)  # greedy: reported at T = 1


def test_sampled_logprobs_are_the_trainers_and_n_samples_differ(setup):
    model, tok, engine, _ = setup
    ids, mask = prompts(tok, TEXTS[:2])
    ids, mask = ids.repeat_interleave(4, 0), mask.repeat_interleave(4, 0)  # n = 4, as Batch.repeat_interleave
    out = engine.generate(ids, mask, SamplingParams(max_new_tokens=10, temperature=0.8, seed=7))
    torch.testing.assert_close(out.logprobs, trainer_logprobs(model, ids, mask, out, 0.8), atol=1e-4, rtol=0)
    for first in (0, 4):  # one request of n = 4 per prompt: four different samples, not one copied
        rows = {tuple(out.responses[first + k][out.response_mask[first + k].bool()].tolist()) for k in range(4)}
        assert len(rows) > 1, rows
    again = engine.generate(ids, mask, SamplingParams(max_new_tokens=10, temperature=0.8, seed=7))
    other = engine.generate(ids, mask, SamplingParams(max_new_tokens=10, temperature=0.8, seed=8))
    assert torch.equal(again.responses, out.responses)  # the call's seed fixes every sample
    assert not torch.equal(other.responses, out.responses)


def test_top_k_samples_inside_the_top_k_and_reports_unfiltered_logprobs(setup):
    model, tok, engine, _ = setup
    ids, mask = prompts(tok, TEXTS)
    out = engine.generate(ids, mask, SamplingParams(max_new_tokens=8, temperature=1.3, top_k=3, seed=1))
    expected = trainer_logprobs(model, ids, mask, out, 1.3)
    torch.testing.assert_close(out.logprobs, expected, atol=1e-5, rtol=0)
    with torch.no_grad():  # each sampled id is among the 3 most likely at its position
        full = torch.cat([ids, out.responses], 1)
        logits = model(full, attention_mask=torch.cat([mask, out.response_mask], 1)).logits[:, ids.shape[1] - 1:-1]
    rank = (logits > logits.gather(2, out.responses[..., None])).sum(-1)
    assert (rank[out.response_mask.bool()] < 3).all()


def test_stop_strings_stop_tokens_and_per_sample_limits_equal_hf(setup):
    model, tok, engine, hf = setup
    ids, mask = prompts(tok, TEXTS)
    free = hf.generate(ids, mask, SamplingParams(max_new_tokens=12, temperature=0.0)).responses
    stop_text = tok.decode([int(free[0, 2])])  # row 0 stops at its 3rd token; the others where that word appears
    stop_id = int(free[1, 3])
    limits = torch.tensor([12, 5, 2])
    for params in (SamplingParams(max_new_tokens=12, temperature=0.0, stop_strings=(stop_text,)),
                   SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=(stop_id,)),
                   SamplingParams(max_new_tokens=12, temperature=0.0, max_new_tokens_per_sample=limits)):
        ours, ref = engine.generate(ids, mask, params), hf.generate(ids, mask, params)
        assert torch.equal(ours.responses, ref.responses), params
        assert torch.equal(ours.response_mask, ref.response_mask), params
        assert ours.finish_reasons == ref.finish_reasons, params
    stopped = engine.generate(ids, mask, SamplingParams(max_new_tokens=12, temperature=0.0, stop_strings=(stop_text,)))
    assert stopped.finish_reasons[0] == FINISH_STOP and int(stopped.response_mask[0].sum()) <= 3
    limited = engine.generate(ids, mask, SamplingParams(max_new_tokens=12, temperature=0.0,
                                                        max_new_tokens_per_sample=limits))
    assert limited.response_mask.sum(1).le(limits).all() and limited.finish_reasons[2] in (FINISH_LENGTH, FINISH_STOP)


def test_bad_input_names_the_field(setup):
    _, tok, engine, _ = setup
    ids, mask = prompts(tok, TEXTS)
    with pytest.raises(ValueError, match=r"max_new_tokens_per_sample\[1\] = 9 is outside 1..max_new_tokens=4"):
        engine.generate(ids, mask, SamplingParams(max_new_tokens=4, max_new_tokens_per_sample=torch.tensor([1, 9, 2])))
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate(ids, torch.zeros_like(mask), SamplingParams())


def test_every_row_draws_its_own_noise_across_requests(setup):
    # One prompt in two requests (rows 0-3 limited to 6 tokens, rows 4-7 to 5): vLLM seeds a request's k-th sample
    # with its seed + k, so requests seeded 0, 1, ... would give row 4 row 1's noise and the same 5 tokens.
    _, tok, engine, _ = setup
    ids, mask = prompts(tok, TEXTS[:1])
    ids, mask = ids.repeat(8, 1), mask.repeat(8, 1)
    limits = torch.tensor([6] * 4 + [5] * 4)
    out = engine.generate(ids, mask, SamplingParams(max_new_tokens=6, temperature=1.0, seed=3,
                                                    max_new_tokens_per_sample=limits))
    heads = [tuple(out.responses[r, :5].tolist()) for r in range(8)]
    assert len(set(heads)) == 8, heads
