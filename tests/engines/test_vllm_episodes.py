"""Multi-turn tool episodes through the real vLLM: the lookup tool's replies are spliced between the model's turns,
the rollout log-probs at model tokens are the trainer's forward over the whole trajectory, and the same
environment runs through the trainer's worker with rollout.engine=vllm."""
from __future__ import annotations

import pytest
import torch

from fleetrl.engines.protocol import SamplingParams
from fleetrl.envs.multiturn import MultiTurnConfig, run_multiturn
from fleetrl.envs.tool_env import lookup_env
from fleetrl.models.logprobs import sequence_logprobs
from tests.engines.vllm_helpers import tiny
from tests.integration.helpers import train_run

pytestmark = pytest.mark.vllm
Q_MARK = 47  # "?" in the tiny vocabulary: the lookup tool's call (fleetrl/models/tiny.py)


def test_lookup_episodes_call_the_tool_and_keep_the_trainers_logprobs():
    from fleetrl.engines.vllm import VLLMRolloutEngine

    model, tok = tiny("llama", seed=5)
    texts = [tok.apply_chat_template([{"role": "user", "content": f"? {k} ="}], tokenize=False,
                                     add_generation_prompt=True) for k in "qbcd"]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():  # raise the logit of "?" after these prompts by ~3, so some episodes call the tool
        h = model.model(**enc).last_hidden_state[:, -1].mean(0)
        model.lm_head.weight[Q_MARK] += 3 * h / h.dot(h)
    engine = VLLMRolloutEngine(model, tok, max_batch=16, max_seq_len=96, seed=0)
    ids, mask = enc["input_ids"].repeat_interleave(2, 0), enc["attention_mask"].repeat_interleave(2, 0)
    samples = [{"data_source": "synthetic/lookup", "ground_truth": "5", "extra_info": {"lookup": {k: "5"}, "key": k}}
               for k in "qqbbccdd"]
    out = run_multiturn(engine, tok, lambda s: lookup_env(with_key=False), ids, mask, samples,
                        SamplingParams(max_new_tokens=1, temperature=1.0, seed=3),
                        MultiTurnConfig(max_turns=2, max_total_tokens=12))
    env_tokens = out.attention_mask.bool() & ~out.loss_mask.bool()
    assert env_tokens.any(), "no episode called the tool; the test needs some"
    called = [b for b in range(len(samples)) if out.episodes[b].env_tokens > 0]
    for b in called:  # the tool's reply (it shows the table's digit "5" = id 9) sits between the two model turns
        assert 9 in out.responses[b][env_tokens[b]].tolist()
    with torch.no_grad():
        recomputed, _ = sequence_logprobs(model, ids, mask, out.responses, out.attention_mask)
    model_tokens = out.loss_mask.bool()
    torch.testing.assert_close(recomputed[model_tokens], out.logprobs[model_tokens], atol=1e-4, rtol=0)
    assert (out.logprobs[~model_tokens] == 0).all()


@pytest.mark.slow
def test_tool_example_trains_two_steps_through_the_worker(tmp_path):
    records = train_run("examples/tools_lookup_tiny.yaml", tmp_path / "tools-vllm", "rollout.engine=vllm",
                        "cluster.backend=local", "data.prompts_per_step=4", "rollout.n=4", "trainer.total_steps=2",
                        "data.val=null", "algorithm.micro_batch_size=16")
    steps = [r for r in records if "train/env/tool_calls" in r]
    assert len(steps) == 2 and all(r["train/env/tool_calls"] >= 0 for r in steps)
    assert sum(r["train/env/tool_calls"] for r in steps) > 0, "no episode called the tool in 2 steps x 16"
