import pytest
import torch

from fleetrl.engines.hf import HFRolloutEngine
from fleetrl.engines.protocol import FINISH_LENGTH, FINISH_STOP, RolloutEngine, SamplingParams
from fleetrl.models.logprobs import sequence_logprobs
from fleetrl.models.tiny import build_tiny_model, build_tiny_tokenizer

TOK = build_tiny_tokenizer()
EOS, PAD = TOK.eos_token_id, TOK.pad_token_id


def _prompts():
    texts = [TOK.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=False)
             for c in ("copy a b c", "add 1 2")]
    enc = TOK(texts, padding=True, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def _engine(seed: int = 0, **kwargs) -> HFRolloutEngine:
    return HFRolloutEngine(build_tiny_model(TOK), TOK, seed=seed, **kwargs)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0)


def test_implements_protocol_and_uses_the_given_model():
    model = build_tiny_model(TOK)
    engine = HFRolloutEngine(model, TOK)
    assert isinstance(engine, RolloutEngine) and engine.model is model and engine.weights_version == 0


def test_greedy_is_deterministic_and_is_argmax():
    engine = _engine()
    prompts, mask = _prompts()
    a, b = engine.generate(prompts, mask, _greedy(4)), engine.generate(prompts, mask, _greedy(4))
    assert torch.equal(a.responses, b.responses) and torch.equal(a.logprobs, b.logprobs)
    with torch.no_grad():
        first = engine.model(input_ids=prompts, attention_mask=mask).logits[:, -1].argmax(-1)
    assert torch.equal(a.responses[:, 0], first)
    assert a.responses.shape == (2, 4) and a.response_mask.tolist() == [[1] * 4] * 2
    assert a.finish_reasons == [FINISH_LENGTH, FINISH_LENGTH]  # max_new_tokens honoured
    assert a.logprobs.dtype == torch.float32 and torch.all(a.logprobs < 0)


def test_mask_exact_after_eos():
    engine = _engine()
    prompts, mask = _prompts()
    free = engine.generate(prompts, mask, _greedy(4)).responses
    trigger = int(free[0, 0])
    assert trigger not in prompts[:, -1].tolist() and trigger not in free[1].tolist()

    def eos_after_trigger(module, args, kwargs, output):
        # make EOS the argmax wherever the previous token is `trigger`: row 0 then ends at step 2
        ids = kwargs["input_ids"][:, -output.logits.shape[1]:]
        output.logits[..., EOS] = torch.where(ids == trigger, 1e4, output.logits[..., EOS])
        return output

    engine.model.register_forward_hook(eos_after_trigger, with_kwargs=True)
    out = engine.generate(prompts, mask, _greedy(4))
    assert out.response_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert out.responses[0].tolist() == [trigger, EOS, PAD, PAD]
    assert torch.equal(out.responses[1], free[1])
    assert out.finish_reasons == [FINISH_STOP, FINISH_LENGTH]
    assert torch.all(out.logprobs[0, 2:] == 0) and out.logprobs[0, 1] > -1e-3  # EOS was near-certain


def test_stop_token_ids_and_trim_to_longest():
    engine = _engine()
    prompts, mask = _prompts()
    free = engine.generate(prompts, mask, _greedy(6)).responses
    stop = int(free[1, 1])
    assert stop not in free[0].tolist() and stop != int(free[1, 0])
    out = engine.generate(prompts, mask, SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=(stop,)))
    assert out.response_mask.tolist() == [[1] * 6, [1, 1, 0, 0, 0, 0]]
    assert out.responses[1].tolist() == free[1, :2].tolist() + [PAD] * 4
    assert out.finish_reasons == [FINISH_LENGTH, FINISH_STOP]
    short = engine.generate(prompts[1:], mask[1:], SamplingParams(max_new_tokens=6, temperature=0.0,
                                                                   stop_token_ids=(stop,)))
    assert short.responses.shape == (1, 2)  # R is the longest response, not max_new_tokens


def test_stop_strings_truncate_exactly():
    engine = _engine()
    prompts, mask = _prompts()
    free = engine.generate(prompts, mask, _greedy(5)).responses
    words = [TOK.convert_ids_to_tokens(row.tolist()) for row in free]
    stop = f"{words[0][1]} {words[0][2]}"  # two words spanning response tokens 1..2 of row 0
    assert stop not in " ".join(words[1])
    out = engine.generate(prompts, mask, SamplingParams(max_new_tokens=5, temperature=0.0, stop_strings=(stop,)))
    assert out.response_mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert out.responses[0].tolist() == free[0, :3].tolist() + [PAD, PAD]
    assert TOK.decode(out.responses[0], skip_special_tokens=True).endswith(stop)
    assert out.finish_reasons == [FINISH_STOP, FINISH_LENGTH]


def test_top_k_one_equals_greedy():
    engine = _engine()
    prompts, mask = _prompts()
    greedy = engine.generate(prompts, mask, _greedy(6))
    sampled = engine.generate(prompts, mask, SamplingParams(max_new_tokens=6, temperature=1.0, top_k=1, seed=3))
    assert torch.equal(sampled.responses, greedy.responses)


def test_seeds_reproduce_and_leave_caller_rng_alone():
    engine = _engine()
    prompts, mask = _prompts()
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=11)
    rng = torch.get_rng_state()
    a = engine.generate(prompts, mask, params)
    assert torch.equal(rng, torch.get_rng_state())
    b = engine.generate(prompts, mask, params)
    c = engine.generate(prompts, mask, SamplingParams(max_new_tokens=8, temperature=1.0, seed=12))
    assert torch.equal(a.responses, b.responses) and not torch.equal(a.responses, c.responses)
    # without a per-call seed: the engine's running generator, reproducible from the engine seed
    unseeded = SamplingParams(max_new_tokens=8, temperature=1.0)
    e1, e2 = _engine(seed=5), _engine(seed=5)
    first, second = e1.generate(prompts, mask, unseeded), e1.generate(prompts, mask, unseeded)
    assert torch.equal(first.responses, e2.generate(prompts, mask, unseeded).responses)
    assert not torch.equal(first.responses, second.responses)
    assert torch.equal(rng, torch.get_rng_state())


def test_logprobs_match_trainer_forward_at_temperature():
    engine = _engine(logprob_chunk_size=3)  # chunked in the engine, unchunked below
    prompts, mask = _prompts()
    out = engine.generate(prompts, mask, SamplingParams(max_new_tokens=8, temperature=0.7, top_p=0.9, seed=1))
    with torch.no_grad():
        expected, _ = sequence_logprobs(engine.model, prompts, mask, out.responses, out.response_mask,
                                        temperature=0.7)
    assert torch.allclose(out.logprobs, expected, atol=1e-5)


def test_forward_logprobs_match_incremental_decoding():
    # generate's KV-cache path and one full forward pass must agree, or engine and trainer would disagree
    model = build_tiny_model(TOK)
    prompts, mask = _prompts()
    with torch.no_grad():
        gen = model.generate(input_ids=prompts, attention_mask=mask, do_sample=False, max_new_tokens=6,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=PAD, eos_token_id=[])
        responses = gen.sequences[:, prompts.shape[1]:]
        incremental = (torch.stack(gen.logits, 1) / 0.7).log_softmax(-1).gather(-1, responses[..., None])[..., 0]
        forward, _ = sequence_logprobs(model, prompts, mask, responses, torch.ones_like(responses), temperature=0.7)
    assert torch.allclose(forward, incremental, atol=1e-5)


def test_load_weights_bumps_version_and_changes_outputs():
    engine = _engine()
    prompts, mask = _prompts()
    before = engine.generate(prompts, mask, _greedy(4))
    new_state = build_tiny_model(TOK, seed=9).state_dict()
    engine.load_weights(new_state, version=3)
    after = engine.generate(prompts, mask, _greedy(4))
    assert engine.weights_version == 3
    assert torch.equal(engine.model.lm_head.weight, new_state["lm_head.weight"])
    assert not torch.equal(before.logprobs, after.logprobs)


def test_load_weights_rejects_mismatch_before_copying():
    engine = _engine()
    original = engine.model.lm_head.weight.clone()
    state = {f"module.{k}": v for k, v in build_tiny_model(TOK, seed=9).state_dict().items()}
    with pytest.raises(ValueError, match="missing .*unexpected .*'module.lm_head.weight'"):
        engine.load_weights(state, version=1)
    partial = {k: v for k, v in build_tiny_model(TOK, seed=9).state_dict().items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match="model.norm.weight"):
        engine.load_weights(partial, version=1)
    assert engine.weights_version == 0 and torch.equal(engine.model.lm_head.weight, original)


def test_train_mode_restored_and_sleep_wake():
    engine = _engine()
    prompts, mask = _prompts()
    engine.model.train()
    engine.sleep()
    engine.wake()
    out = engine.generate(prompts, mask, _greedy(2))
    assert engine.model.training and out.responses.shape == (2, 2)


def test_invalid_params():
    engine = _engine()
    prompts, mask = _prompts()
    with pytest.raises(ValueError, match="top_p"):
        engine.generate(prompts, mask, SamplingParams(top_p=0.0))
    with pytest.raises(ValueError, match=r"\[B, P\]"):
        engine.generate(prompts[0], mask[0], SamplingParams())
