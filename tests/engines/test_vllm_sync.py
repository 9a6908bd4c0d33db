"""Weight sync into the real vLLM: after an optimiser step and a sync vLLM samples from the new weights, and a sync
that leaves vLLM with other weights than the trainer's is caught by the log-prob probe, naming the version."""
from __future__ import annotations

import pytest
import torch

from fleetrl.engines.protocol import SamplingParams
from tests.engines.vllm_helpers import TEXTS, prompts, tiny, trainer_logprobs

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def setup():
    from fleetrl.engines.vllm import VLLMRolloutEngine

    model, tok = tiny("llama", seed=3)
    return model, tok, VLLMRolloutEngine(model, tok, max_batch=8, max_seq_len=96, seed=0)


def _optimiser_step(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> None:
    """One AdamW step raising the likelihood of the prompts themselves (any loss does: the weights must move)."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    model.train()
    logits = model(ids, attention_mask=mask).logits[:, :-1]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    model.eval()


def test_after_a_step_and_a_sync_vllm_follows_the_new_weights(setup):
    model, tok, engine = setup
    ids, mask = prompts(tok, TEXTS)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=5)
    before = engine.generate(ids, mask, params)
    old = trainer_logprobs(model, ids, mask, before, 1.0)
    _optimiser_step(model, ids, mask)
    stale = engine.generate(ids, mask, params)  # not synced yet: vLLM still holds version 0's weights
    torch.testing.assert_close(stale.logprobs, old, atol=1e-4, rtol=0)
    engine.sync(1)
    assert engine.weights_version == 1 and engine.last_gap < 1e-4
    after = engine.generate(ids, mask, params)
    torch.testing.assert_close(after.logprobs, trainer_logprobs(model, ids, mask, after, 1.0), atol=1e-4, rtol=0)
    # the step moved the same samples' log-probs by far more than the tolerance used above
    moved = (trainer_logprobs(model, ids, mask, before, 1.0) - old).abs().max()
    assert moved > 0.05, moved


def test_load_weights_copies_into_the_model_and_syncs(setup):
    model, tok, engine = setup
    from fleetrl.models.tiny import build_tiny_model  # a different seed: another model of the same shape

    other = build_tiny_model(tok, hidden_size=128, num_heads=2, seed=11)
    engine.load_weights(other.state_dict(), 2)
    assert engine.weights_version == 2 and engine.last_gap < 1e-4
    assert torch.equal(model.model.embed_tokens.weight, other.model.embed_tokens.weight)
    ids, mask = prompts(tok, TEXTS)
    out = engine.generate(ids, mask, SamplingParams(max_new_tokens=6, temperature=0.7, seed=2))
    torch.testing.assert_close(out.logprobs, trainer_logprobs(other, ids, mask, out, 0.7), atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match=r"load_weights\(version=3\): 1 names are not in the engine's"):
        engine.load_weights({"model.layers.9.mlp.up_proj.weight": torch.zeros(1)}, 3)


def test_a_mismatched_sync_is_caught_naming_the_version_and_gap(setup):
    from fleetrl.engines.vllm.check import VLLMSyncError

    model, tok, engine = setup
    version = engine.weights_version
    # vLLM receives one layer's MLP scaled (a corrupted transfer) while the trainer keeps its weights
    state = model.state_dict()
    bad = [(n, t * 3 if n == "model.layers.1.mlp.down_proj.weight" else t) for n, t in state.items()]
    with pytest.raises(VLLMSyncError, match=rf"sync to version {version + 1} is wrong: .* differ .* by up to "
                                            r"[0-9.e-]+ on the 16-token probe, beyond the baseline gap"):
        engine.sync(version + 1, bad)
    assert engine.weights_version == version  # a refused sync does not claim the version
    engine.sync(version + 1)  # the right weights pass again
    assert engine.last_gap < 1e-4
