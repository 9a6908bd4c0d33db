"""FastRolloutEngine on CPU fp32: exact against HF generate / a training forward, continuous batching, masks."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from fleetrl.engines.fast import FastRolloutEngine
from fleetrl.engines.protocol import FINISH_LENGTH, FINISH_STOP, RolloutEngine, SamplingParams

VOCAB = 50
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)


class CharTokenizer:
    """id i <-> one character, enough for EOS and stop strings."""

    pad_token_id = 0

    def __init__(self, eos: int | None) -> None:
        self.eos_token_id = eos

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("!") + i) for i in ids)


def tiny_model(arch: str, eos: int | None = None, **shape: int) -> torch.nn.Module:
    """`shape`: SHAPE's fields to change (e.g. hidden_size for another head dim)."""
    torch.manual_seed(0)
    dims = {**SHAPE, **shape}
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**dims, rope_theta=500000.0, eos_token_id=eos))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**dims, eos_token_id=eos))  # q/k/v biases
        with torch.no_grad():  # HF zero-inits biases; make them matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    with torch.no_grad():  # HF ones-inits the norms; make their weights matter (the Triton decode folds them: fused.py)
        for norm in [m for layer in model.model.layers for m in (layer.input_layernorm, layer.post_attention_layernorm)]:
            norm.weight.uniform_(0.5, 1.5)
    model.generation_config.eos_token_id = eos
    return model.eval()


def left_padded(lengths: list[int], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(1, VOCAB, (len(lengths), width), generator=g)
    mask = (torch.arange(width)[None, :] >= width - torch.tensor(lengths)[:, None]).long()
    return ids * mask, mask


def engine(model: torch.nn.Module, eos: int | None, **kw) -> FastRolloutEngine:
    return FastRolloutEngine(model, CharTokenizer(eos), device="cpu", max_seq_len=64, **kw)


def hf_greedy(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, new: int, eos: int | None):
    out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new, eos_token_id=eos,
                         pad_token_id=0)
    return out[:, ids.shape[1]:]


def training_logprobs(model, ids, mask, out, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) at the response ids from one full-sequence forward, 0 where masked."""
    full = torch.cat([ids, out.responses], 1)
    with torch.no_grad():
        logits = model(full, attention_mask=torch.cat([mask, out.response_mask], 1)).logits.float()
    logits = logits[:, ids.shape[1] - 1:-1] / temperature
    return torch.log_softmax(logits, -1).gather(2, out.responses[..., None])[..., 0] * out.response_mask


def expected_mask(tokens: torch.Tensor, eos: int) -> torch.Tensor:
    """1 through the first EOS (inclusive), 0 after."""
    is_eos = (tokens == eos).long()
    seen_before = torch.cumsum(is_eos, 1) - is_eos
    return (seen_before == 0).long()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_matches_hf_generate(arch: str) -> None:
    ids, mask = left_padded([3, 9, 6, 1])
    probe = hf_greedy(tiny_model(arch), ids, mask, 12, None)
    eos = int(probe[0, 4])  # a token greedy really emits, so some rows stop early
    model = tiny_model(arch, eos)
    ref = hf_greedy(model, ids, mask, 12, eos)
    out = engine(model, eos).generate(ids, mask, SamplingParams(max_new_tokens=12, temperature=0.0))
    ref_mask = expected_mask(ref, eos)
    assert out.responses.shape == ref.shape
    assert torch.equal(out.response_mask, ref_mask)
    assert torch.equal(out.responses, ref * ref_mask)
    assert out.finish_reasons[0] == FINISH_STOP


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_sampled_logprobs_match_training_forward(arch: str) -> None:
    model = tiny_model(arch)
    ids, mask = left_padded([5, 2, 8])
    eng = engine(model, None)
    for params in (SamplingParams(max_new_tokens=16, temperature=0.7, seed=3),
                   SamplingParams(max_new_tokens=16, temperature=1.3, top_k=5, top_p=0.9, seed=4)):
        out = eng.generate(ids, mask, params)
        assert out.response_mask.all() and out.finish_reasons == [FINISH_LENGTH] * 3
        ref = training_logprobs(model, ids, mask, out, params.temperature)
        torch.testing.assert_close(out.logprobs, ref, atol=1e-5, rtol=0)
    # the top-k=5 call only ever picks tokens among the 5 most likely
    full = torch.cat([ids, out.responses], 1)
    with torch.no_grad():
        logits = model(full, attention_mask=torch.cat([mask, out.response_mask], 1)).logits[:, ids.shape[1] - 1:-1]
    rank = (logits > logits.gather(2, out.responses[..., None])).sum(-1)
    assert (rank < 5).all()


def test_greedy_logprob_is_temperature_one() -> None:
    model = tiny_model("qwen2")
    ids, mask = left_padded([4, 7])
    out = engine(model, None).generate(ids, mask, SamplingParams(max_new_tokens=6, temperature=0.0))
    torch.testing.assert_close(out.logprobs, training_logprobs(model, ids, mask, out, 1.0), atol=1e-5, rtol=0)


def test_continuous_batching_equals_running_alone() -> None:
    model = tiny_model("llama")
    lengths = [3, 11, 1, 7, 5, 9, 2]
    ids, mask = left_padded(lengths, seed=7)
    probe = engine(model, None).generate(ids, mask, SamplingParams(max_new_tokens=10, temperature=0.0))
    eos = int(probe.responses[1, 3])  # rows finish at different steps, so slots free up mid-run
    eng = engine(model, eos, max_batch=2, sync_every=3)
    params = SamplingParams(max_new_tokens=10, temperature=0.0)
    out = eng.generate(ids, mask, params)
    assert eng.stats["prefills"] > 1
    for i, n in enumerate(lengths):
        alone = engine(model, eos, max_batch=1).generate(ids[i:i + 1, -n:], mask[i:i + 1, -n:], params)
        r = alone.responses.shape[1]
        assert torch.equal(out.responses[i, :r], alone.responses[0]), i
        assert torch.equal(out.response_mask[i, :r], alone.response_mask[0]), i
        assert not out.response_mask[i, r:].any()
        assert out.finish_reasons[i] == alone.finish_reasons[0]


def test_eos_masking_exact() -> None:
    model = tiny_model("qwen2")
    ids, mask = left_padded([6, 6, 3, 8], seed=3)
    probe = engine(model, None).generate(ids, mask, SamplingParams(max_new_tokens=14, temperature=1.0, seed=9))
    eos = int(probe.responses[0, 2])
    out = engine(model, eos).generate(ids, mask, SamplingParams(max_new_tokens=14, temperature=1.0, seed=9))
    # same seed, same stream: rows are the probe's rows cut after their first EOS
    want = expected_mask(probe.responses, eos)[:, :out.responses.shape[1]]
    assert torch.equal(out.response_mask, want)
    assert torch.equal(out.responses, probe.responses[:, :want.shape[1]] * want)
    assert (out.logprobs[want == 0] == 0).all() and (out.logprobs[want == 1] < 0).all()
    for row, m, reason in zip(out.responses, out.response_mask, out.finish_reasons):
        last = row[m.sum() - 1]
        assert reason == (FINISH_STOP if last == eos else FINISH_LENGTH)
    assert out.finish_reasons[0] == FINISH_STOP and out.response_mask[0].sum() <= 3


def test_same_seed_reproduces_samples() -> None:
    model = tiny_model("llama")
    ids, mask = left_padded([4, 9, 2])
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=123)
    a = engine(model, None).generate(ids, mask, params)
    b = engine(model, None, max_batch=1).generate(ids, mask, params)  # other slots/steps, same streams
    c = engine(model, None).generate(ids, mask, SamplingParams(max_new_tokens=12, temperature=1.0, seed=124))
    assert torch.equal(a.responses, b.responses)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)  # other batch shapes round differently
    assert not torch.equal(a.responses, c.responses)
    # seed=None: the engine's own generator, seeded at construction
    runs = [engine(model, None, seed=5).generate(ids, mask, SamplingParams(max_new_tokens=8)) for _ in range(2)]
    assert torch.equal(runs[0].responses, runs[1].responses)


def test_stop_strings_truncate_on_host() -> None:
    model = tiny_model("qwen2")
    ids, mask = left_padded([5, 5])
    eng = engine(model, None)
    base = eng.generate(ids, mask, SamplingParams(max_new_tokens=10, temperature=0.0))
    stop = CharTokenizer(None).decode(base.responses[0, 3:5].tolist())  # two characters from row 0
    out = eng.generate(ids, mask, SamplingParams(max_new_tokens=10, temperature=0.0, stop_strings=(stop,)))
    text = CharTokenizer(None).decode(base.responses[0].tolist())
    cut = text.index(stop) + len(stop)
    assert out.response_mask[0].sum() == cut and out.finish_reasons[0] == FINISH_STOP
    assert torch.equal(out.responses[0, :cut], base.responses[0, :cut])


def test_uses_trainer_weights_in_place_and_load_weights() -> None:
    model = tiny_model("llama")
    ids, mask = left_padded([4, 6])
    eng = engine(model, None)
    assert isinstance(eng, RolloutEngine)
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    before = eng.generate(ids, mask, params)
    with torch.no_grad():  # an "optimizer step" on the trainer's tensors, seen without any sync
        model.lm_head.weight.mul_(-1.0)
    flipped = eng.generate(ids, mask, params)
    assert not torch.equal(before.responses, flipped.responses)
    eng.load_weights({"lm_head.weight": -model.lm_head.weight.detach()}, version=7)
    assert eng.weights_version == 7
    assert torch.equal(eng.generate(ids, mask, params).responses, before.responses)
    with pytest.raises(ValueError, match="not a parameter"):
        eng.load_weights({"nope.weight": torch.zeros(1)}, version=8)
    eng.sleep()
    eng.wake()
    assert torch.equal(eng.generate(ids, mask, params).responses, before.responses)


def test_one_token_and_input_errors() -> None:
    model = tiny_model("qwen2")
    ids, mask = left_padded([3, 5])
    eng = engine(model, None)
    out = eng.generate(ids, mask, SamplingParams(max_new_tokens=1, temperature=0.0))
    assert out.responses.shape == (2, 1) and out.finish_reasons == [FINISH_LENGTH] * 2
    with pytest.raises(ValueError, match="max_seq_len"):
        eng.generate(ids, mask, SamplingParams(max_new_tokens=62))
    model.config.model_type = "gpt2"
    with pytest.raises(ValueError, match="model types") as err:
        FastRolloutEngine(model, None, device="cpu")
    assert "rollout.engine=vllm" in str(err.value) and "rollout.engine=hf" in str(err.value)  # where to go instead
