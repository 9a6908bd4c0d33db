"""EngineStream (engines/fast/stream.py): continuous batching across generate calls with in-flight weight updates.

Calls from several threads share one engine loop and each gets what a call of its own gives (greedy tokens and
log-probs; sampled log-probs equal a training forward's); a call with another sampler setting waits for the running
samples; a call tagged with a version the engine lacks waits until it is offered. Weights installed between decode
rounds: the running samples keep their KV caches and decode on with the new weights, each token tagged with the
version that sampled it, and the reference for that is built by hand from HF: the old model's cache for the tokens
before the switch, the new model from there on. A failing loop fails every waiting call and the later ones."""
from __future__ import annotations

import threading

import pytest
import torch

from fleetrl.engines.fast.stream import EngineStream, request_key
from fleetrl.engines.protocol import SamplingParams
from tests.engines.test_fast import engine, left_padded, tiny_model, training_logprobs
from tests.engines.test_fast_tp import _same

GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0)


def _threads(stream: EngineStream, calls: list[tuple]) -> list:
    """Each (ids, mask, params[, min_version]) through the stream from its own thread, all at once -> outputs."""
    outs: list = [None] * len(calls)

    def run(i: int) -> None:
        outs[i] = stream.generate(*calls[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(o is not None for o in outs), "a call did not return"
    return outs


def test_calls_share_the_loop_and_get_what_a_call_of_their_own_gets() -> None:
    model = tiny_model("llama")
    plain = engine(model, None, max_batch=3, sync_every=2)
    streamed = EngineStream(engine(model, None, max_batch=3, sync_every=2), install=lambda: None)
    a, b, c = left_padded([5, 2, 8, 8]), left_padded([3, 6], seed=4), left_padded([7, 1, 4], seed=5)
    outs = _threads(streamed, [(*a, GREEDY), (*b, GREEDY), (*c, GREEDY)])
    for (ids, mask), (out, versions) in zip((a, b, c), outs):
        _same(plain.generate(ids, mask, GREEDY), out)
        assert not versions.any()  # version 0 throughout
    assert streamed.stats["sessions"] <= 2 and streamed.stats["calls"] == 3  # one loop served them together
    sampled = SamplingParams(max_new_tokens=12, temperature=0.9, seed=7)
    out, _ = streamed.generate(*a, sampled)
    torch.testing.assert_close(out.logprobs, training_logprobs(model, *a, out, 0.9), atol=1e-5, rtol=0)
    again, _ = streamed.generate(*a, sampled)
    assert torch.equal(out.responses, again.responses), "a sample's draws are keyed by its call's seed and index"
    (one, _), (two, _) = _threads(streamed, [(*a, sampled), (*a, sampled)])
    assert not torch.equal(one.responses, two.responses), "two live samples never share a random stream"
    assert request_key(7, 0) != request_key(7, 1) != request_key(8, 1)


def test_another_sampler_setting_waits_and_a_call_waits_for_its_weights() -> None:
    model = tiny_model("qwen2")
    plain = engine(model, None)
    offered = [0]
    eng = engine(model, None, max_batch=4)

    def install() -> None:
        eng.weights_version = max(eng.weights_version, offered[0])  # the same weights under a new number

    stream = EngineStream(eng, install=install)
    ids, mask = left_padded([4, 6, 3])
    hot = SamplingParams(max_new_tokens=8, temperature=1.1, seed=2)
    with pytest.raises(RuntimeError, match="needs weights version 1, but the newest offered .* is 0"):
        stream.generate(ids, mask, GREEDY, min_version=1)  # nothing offered: it would wait forever
    stream.poke(1)  # offered, still on its way (the worker fetches it beside the decoding)
    waiting: list = []
    t = threading.Thread(target=lambda: waiting.append(stream.generate(ids, mask, GREEDY, min_version=1)))
    t.start()
    (out_hot, _), (out_greedy, _) = _threads(stream, [(ids, mask, hot), (ids, mask, GREEDY)])
    _same(plain.generate(ids, mask, GREEDY), out_greedy)
    torch.testing.assert_close(out_hot.logprobs, training_logprobs(model, ids, mask, out_hot, 1.1), atol=1e-5, rtol=0)
    assert not waiting, "version 1 is not offered yet"
    offered[0] = 1  # arrived
    stream.poke(1)
    t.join(30)
    out, versions = waiting[0]
    _same(plain.generate(ids, mask, GREEDY), out)
    assert (versions[out.response_mask.bool()] == 1).all()
    assert stream.exclusive(lambda: eng.weights_version) == 1


def _reference(old: torch.nn.Module, new: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, row: int,
               switch: int, n: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and log-probs of sample `row` when tokens [0, switch) come from `old` and the rest from `new`,
    with the KV cache of everything before the switch computed by `old` (the in-flight update's semantics)."""
    keep = mask[row].bool()
    prompt = ids[row][keep][None]
    toks, lps = [], []
    with torch.no_grad():
        out = old(prompt, use_cache=True)
        cache, logits = out.past_key_values, out.logits[0, -1]
        for t in range(n):
            model = old if t + 1 < switch else new  # the token after t is sampled by whoever runs step t + 1
            lp = torch.log_softmax(logits.float(), -1)
            tok = int(lp.argmax())
            toks.append(tok)
            lps.append(float(lp[tok]))
            step = model(torch.tensor([[tok]]), past_key_values=cache, use_cache=True)
            cache, logits = step.past_key_values, step.logits[0, -1]
    return toks, lps


# A GPU engine decodes from fused q/k/v and gate/up copies by default, refreshed where the weights change. The first
# GPU run failed on a stale fused copy at the stream's first call, which the CPU's default (no copies) never ran.
COPIES = [pytest.param({}, id="model-tensors"), pytest.param({"fuse_projections": True}, id="fused")]


@pytest.mark.parametrize("copies", COPIES)
def test_weights_installed_in_flight_keep_the_caches_and_tag_each_token(copies: dict) -> None:
    old, new = tiny_model("llama"), tiny_model("llama")
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    target = {k: v.clone() for k, v in new.state_dict().items()}
    model = tiny_model("llama")  # the engine's weights: old's, until the install
    eng = engine(model, None, max_batch=4, sync_every=3, **copies)
    rounds = [0]

    def install() -> None:  # the worker's load: the new state in place, after the first decode round
        rounds[0] += 1
        if rounds[0] == 3 and eng.weights_version == 0:
            eng.load_weights(target, version=1)

    stream = EngineStream(eng, install=install)
    ids, mask = left_padded([5, 2, 8, 3])
    out, versions = stream.generate(ids, mask, SamplingParams(max_new_tokens=12, temperature=0.0))
    assert stream.stats["installs"] == stream.stats["in_flight_installs"] == 1
    for row in range(len(ids)):
        v = versions[row]
        switch = int((v == 0).sum())
        assert 0 < switch < 12 and (v[:switch] == 0).all() and (v[switch:] == 1).all(), v
        toks, lps = _reference(old, new, ids, mask, row, switch, 12)
        assert out.responses[row].tolist() == toks
        torch.testing.assert_close(out.logprobs[row], torch.tensor(lps), atol=1e-5, rtol=0)


def test_a_failing_loop_fails_the_waiting_calls_and_the_later_ones() -> None:
    eng = engine(tiny_model("llama"), None)

    def broken() -> None:
        raise RuntimeError("object store unreachable")

    stream = EngineStream(eng, install=broken)
    ids, mask = left_padded([3, 4])
    with pytest.raises(RuntimeError, match="object store unreachable"):
        stream.generate(ids, mask, GREEDY)
    with pytest.raises(RuntimeError, match="stream failed earlier"):
        stream.generate(ids, mask, GREEDY)


def test_per_sample_limits_and_stop_strings_as_a_call_of_their_own() -> None:
    """Long-tailed limits (bench/longtail.py's seam): requests of one call finish in different harvests."""
    model = tiny_model("qwen2")
    ids, mask = left_padded([5, 2, 8, 3, 6])
    limits = torch.tensor([2, 11, 4, 1, 7])
    params = SamplingParams(max_new_tokens=11, temperature=0.0, max_new_tokens_per_sample=limits)
    plain = engine(model, None, max_batch=2, sync_every=2)
    stream = EngineStream(engine(model, None, max_batch=2, sync_every=2), install=lambda: None)
    other = left_padded([4, 4], seed=9)
    (out, _), (out2, _) = _threads(stream, [(ids, mask, params), (*other, GREEDY)])
    _same(plain.generate(ids, mask, params), out)
    _same(plain.generate(*other, GREEDY), out2)
    assert out.response_mask.sum(1).tolist() == limits.tolist()
    assert stream.take_idle_s() >= 0.0


def test_a_model_with_adapters_is_refused():
    from fleetrl.config.schema import LoraConfig
    from fleetrl.models.lora import apply_lora

    model = tiny_model("llama")
    apply_lora(model, LoraConfig(rank=2, alpha=4.0))
    with pytest.raises(ValueError, match="carries LoRA adapters"):
        EngineStream(engine(model, None), install=lambda: None)
