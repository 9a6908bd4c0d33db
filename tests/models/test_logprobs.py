import pytest
import torch

from fleetrl.models.logprobs import build_inputs, sequence_logprobs
from fleetrl.models.tiny import build_tiny_model, build_tiny_tokenizer


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(build_tiny_tokenizer(), seed=1)


def _batch():
    prompts = torch.tensor([[0, 0, 49, 14], [49, 48, 15, 16], [0, 0, 0, 40]])
    responses = torch.tensor([[17, 1, 0, 0], [18, 19, 20, 21], [22, 23, 1, 0]])
    response_mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0]])
    return prompts, (prompts != 0).long(), responses, response_mask


def test_build_inputs_hand_checked():
    ids, attn, pos = build_inputs(torch.tensor([[0, 5, 6], [7, 8, 9]]), torch.tensor([[0, 1, 1], [1, 1, 1]]),
                                  torch.tensor([[10, 1, 0], [11, 12, 13]]), torch.tensor([[1, 1, 0], [1, 1, 1]]))
    assert ids.tolist() == [[0, 5, 6, 10, 1, 0], [7, 8, 9, 11, 12, 13]]
    assert attn.tolist() == [[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]
    # cumsum - 1 = [-1, 0, 1, 2, 3, 3] -> clipped at 0
    assert pos.tolist() == [[0, 0, 1, 2, 3, 3], [0, 1, 2, 3, 4, 5]]


def test_matches_manual_single_sample(model):
    prompt, response, T = torch.tensor([[49, 48, 14]]), torch.tensor([[15, 16]]), 0.7
    logp, entropy = sequence_logprobs(model, prompt, torch.ones_like(prompt), response, torch.ones_like(response),
                                      temperature=T, return_entropy=True)
    with torch.no_grad():
        logits = model(torch.tensor([[49, 48, 14, 15, 16]])).logits[0] / T
    # logits at column 2 predict token 15, column 3 predicts 16
    manual = torch.stack([logits[2].log_softmax(-1)[15], logits[3].log_softmax(-1)[16]])
    assert torch.allclose(logp[0], manual, atol=1e-6)
    probs = logits[2:4].softmax(-1)
    assert torch.allclose(entropy[0], -(probs * probs.log()).sum(-1), atol=1e-5)


def test_left_padding_does_not_change_logprobs(model):
    prompts, prompt_mask, responses, response_mask = _batch()
    logp, _ = sequence_logprobs(model, prompts, prompt_mask, responses, response_mask)
    alone, _ = sequence_logprobs(model, prompts[2:, 3:], prompt_mask[2:, 3:], responses[2:, :3],
                                 response_mask[2:, :3])
    assert torch.allclose(logp[2, :3], alone[0], atol=1e-5)


def test_chunked_equals_unchunked_and_masked_zero(model):
    batch = _batch()
    with torch.no_grad():
        full, ent_full = sequence_logprobs(model, *batch, temperature=0.9, return_entropy=True)
        for chunk in (1, 3, 100):
            part, ent_part = sequence_logprobs(model, *batch, temperature=0.9, return_entropy=True, chunk_size=chunk)
            assert torch.allclose(part, full, atol=1e-6) and torch.allclose(ent_part, ent_full, atol=1e-6)
    mask = batch[3]
    assert full.dtype == torch.float32 and full.shape == (3, 4)
    assert torch.all(full[mask == 0] == 0) and torch.all(ent_full[mask == 0] == 0)
    assert torch.all(full[mask == 1] < 0) and torch.all(ent_full[mask == 1] > 0)


def test_chunked_gradients_match(model):
    batch = _batch()
    grads = []
    for chunk in (None, 2):
        model.zero_grad()
        logp, _ = sequence_logprobs(model, *batch, chunk_size=chunk)
        logp.sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    model.zero_grad()
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-6)


def test_bad_arguments(model):
    with pytest.raises(ValueError, match="temperature must be > 0"):
        sequence_logprobs(model, *_batch(), temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        sequence_logprobs(model, *_batch(), chunk_size=0)


def test_shared_prompts_equal_the_full_forward(model, monkeypatch):
    # Rows 0, 1 and 3 share a left-padded prompt, row 2 has its own: the backbone sees 2 distinct prompts once each
    # (and then the 4 rows' responses), and log-probs, entropies and gradients equal the one-pass forward's.
    prompts, prompt_mask, responses, response_mask = _batch()
    prompts, prompt_mask = prompts[[0, 0, 1, 0]], prompt_mask[[0, 0, 1, 0]]
    responses, response_mask = responses[[0, 1, 2, 2]], response_mask[[0, 1, 2, 2]]
    seen = []
    backbone = model.model
    monkeypatch.setattr(backbone, "forward", lambda *a, _f=backbone.forward, **kw: seen.append(kw["input_ids"].shape)
                        or _f(*a, **kw))
    out = {}
    for share in (False, True):
        model.zero_grad()
        seen.clear()
        logp, ent = sequence_logprobs(model, prompts, prompt_mask, responses, response_mask, chunk_size=2,
                                      return_entropy=True, share_prompts=share)
        (logp.sum() + ent.sum()).backward()
        out[share] = (logp.detach(), ent.detach(), [p.grad.clone() for p in model.parameters()], list(seen))
    model.zero_grad()
    assert out[False][3] == [torch.Size([4, 8])]  # prompt 4 + response 4 columns, every row
    assert out[True][3] == [torch.Size([2, 4]), torch.Size([4, 4])]  # 2 distinct prompts, then 4 responses
    torch.testing.assert_close(out[True][0], out[False][0], atol=1e-6, rtol=0)
    torch.testing.assert_close(out[True][1], out[False][1], atol=1e-6, rtol=0)
    for a, b in zip(out[False][2], out[True][2]):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)


def test_share_prompts_needs_the_chunked_padded_forward():
    from fleetrl.config import derive_plan, load_config
    from fleetrl.config.load import ConfigError

    with pytest.raises(ConfigError, match=r"actor.share_prompts with actor.forward=hf works on the padded, chunked "
                                          r"forward only; got actor.logprob_chunk=None.*or actor.forward=native"):
        derive_plan(load_config(None, ["actor.share_prompts=true"]))
    assert derive_plan(load_config(None, ["actor.share_prompts=true", "actor.logprob_chunk=16"])).config.actor.share_prompts


@pytest.mark.parametrize("chunk", [None, 2])
def test_metric_entropy_equals_the_differentiable_one_without_a_graph(model, chunk):
    batch = _batch()
    logp, ent = sequence_logprobs(model, *batch, temperature=0.9, return_entropy=True, chunk_size=chunk)
    logp_m, ent_m = sequence_logprobs(model, *batch, temperature=0.9, return_entropy="metric", chunk_size=chunk)
    assert ent.requires_grad and not ent_m.requires_grad  # the metric entropy keeps no autograd graph
    assert logp_m.requires_grad  # log-probs still carry the policy gradient
    torch.testing.assert_close(ent_m, ent.detach(), rtol=0, atol=0)
    torch.testing.assert_close(logp_m, logp, rtol=0, atol=0)
