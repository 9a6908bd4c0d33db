"""Partial rollouts (workers/partial.py): the per-token version bookkeeping of a segmented call, with hand-computed
expectations on a scripted engine; and on the real engines (CPU, fp32), a segmented greedy call continues the
prefix exactly: the same tokens and log-probs as one uncut call."""
from __future__ import annotations

import torch

from fleetrl.engines.hf import HFRolloutEngine
from fleetrl.engines.protocol import FINISH_LENGTH, FINISH_STOP, GenerationOutput, SamplingParams, response_limits
from fleetrl.models.tiny import build_tiny_model, build_tiny_tokenizer
from fleetrl.workers.partial import PartialSamples, generate_in_segments, segment_seed
from tests.engines.test_fast import engine, left_padded, tiny_model

EOS = 99


class ScriptedEngine:
    """Each new token is 10·version + L, L the row's sequence length (prompt + tokens so far) before it; a row
    whose first prompt token is in `eos_at` samples EOS when L reaches that length. Log-prob of a token: -L/100."""

    def __init__(self, eos_at: dict[int, int]) -> None:
        self.weights_version = 0
        self.eos_at = eos_at
        self.calls: list[tuple[list[list[int]], list[int]]] = []  # (unpadded inputs, budgets) per call

    def generate(self, prompts: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams) -> GenerationOutput:
        limits = response_limits(params, prompts.shape[0]).tolist()
        rows = [prompts[b][prompt_mask[b].bool()].tolist() for b in range(prompts.shape[0])]
        self.calls.append((rows, limits))
        toks, lps, finish = [], [], []
        for row, limit in zip(rows, limits):
            out, lp, why = [], [], FINISH_LENGTH
            for _ in range(limit):
                L = len(row) + len(out)
                lp.append(-L / 100)
                if self.eos_at.get(row[0]) == L:
                    out.append(EOS)
                    why = FINISH_STOP
                    break
                out.append(10 * self.weights_version + L)
            toks.append(out), lps.append(lp), finish.append(why)
        width = max(len(t) for t in toks)
        responses = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        logprobs = torch.zeros((len(rows), width))
        for i, (t, lp) in enumerate(zip(toks, lps)):
            responses[i, :len(t)], mask[i, :len(t)], logprobs[i, :len(t)] = torch.tensor(t), 1, torch.tensor(lp)
        return GenerationOutput(responses=responses, response_mask=mask, logprobs=logprobs, finish_reasons=finish)


def _prompts(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = torch.tensor(r), 1
    return ids, mask


def test_tokens_record_the_version_of_the_segment_that_sampled_them():
    # 4 samples, segments of 2 tokens, max_new_tokens 5 (sample 1: its own limit 3); a new version is installed
    # before every segment after the first (the worker's install_newest), so segment j decodes at version j.
    eng = ScriptedEngine(eos_at={5: 5, 8: 3})
    ids, mask = _prompts([[5, 6], [7], [8, 9, 9], [4]])
    params = SamplingParams(max_new_tokens=5, temperature=1.0, seed=3,
                            max_new_tokens_per_sample=torch.tensor([5, 3, 5, 5]))
    installs = iter(range(10))

    def newest() -> None:
        eng.weights_version = next(installs)

    gen, versions, segments = generate_in_segments(eng, ids, mask, params, segment_tokens=2, pad_id=0,
                                                   before_segment=newest)
    # sample 0: L=2,3 at v0 -> 2, 3; L=4 at v1 -> 14; L=5 is its EOS (at v1).
    # sample 1: 1, 2 at v0; its limit 3 leaves a 1-token segment: 13 at v1; done (length).
    # sample 2: EOS at L=3 right away (one segment, v0).
    # sample 3: 1, 2 at v0; 13, 14 at v1; 25 at v2 (the fifth token: max_new_tokens).
    expect = [[2, 3, 14, EOS], [1, 2, 13], [EOS], [1, 2, 13, 14, 25]]
    expect_versions = [[0, 0, 1, 1], [0, 0, 1], [0], [0, 0, 1, 1, 2]]
    for b in range(4):
        n = len(expect[b])
        assert gen.responses[b, :n].tolist() == expect[b]
        assert gen.response_mask[b].tolist() == [1] * n + [0] * (5 - n)
        assert versions[b].tolist() == expect_versions[b] + [0] * (5 - n)
    # the behaviour log-prob of every token is the one its own segment reported (-L/100)
    assert torch.allclose(gen.logprobs[0, :4], torch.tensor([-0.02, -0.03, -0.04, -0.05]))
    assert torch.allclose(gen.logprobs[3], torch.tensor([-0.01, -0.02, -0.03, -0.04, -0.05]))
    assert gen.finish_reasons == [FINISH_STOP, FINISH_LENGTH, FINISH_STOP, FINISH_LENGTH]
    assert segments.tolist() == [2, 2, 1, 3]
    # What the engine was asked: the unfinished rows' prompt plus tokens so far, each for what is left of its budget.
    assert eng.calls == [
        ([[5, 6], [7], [8, 9, 9], [4]], [2, 2, 2, 2]),
        ([[5, 6, 2, 3], [7, 1, 2], [4, 1, 2]], [2, 1, 2]),
        ([[4, 1, 2, 13, 14]], [1]),
    ]


def test_a_stop_string_across_a_cut_ends_the_sample_where_it_first_appears():
    eng = ScriptedEngine(eos_at={})
    ids, mask = _prompts([[4], [6, 6, 6]])
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    installs = iter(range(10))

    def newest() -> None:
        eng.weights_version = next(installs)

    def stop_end(tokens: list[int]) -> int | None:  # "stop string": token 2 directly followed by 13
        for i in range(1, len(tokens)):
            if tokens[i - 1:i + 1] == [2, 13]:
                return i
        return None

    gen, versions, segments = generate_in_segments(eng, ids, mask, params, segment_tokens=2, pad_id=0,
                                                   before_segment=newest, stop_end=stop_end)
    # sample 0: 1, 2 (v0) | 13, 14 (v1): the stop spans the cut, so it ends at 13 (14 is dropped with its version
    # and log-prob). Sample 1 (L from 3): 3, 4 | 15, 16 | 27, 28: never matches, runs to max_new_tokens.
    assert gen.responses[0, :3].tolist() == [1, 2, 13] and int(gen.response_mask[0].sum()) == 3
    assert versions[0].tolist() == [0, 0, 1, 0, 0, 0]
    assert torch.allclose(gen.logprobs[0], torch.tensor([-0.01, -0.02, -0.03, 0, 0, 0]))
    assert gen.responses[1].tolist() == [3, 4, 15, 16, 27, 28] and versions[1].tolist() == [0, 0, 1, 1, 2, 2]
    assert gen.finish_reasons == [FINISH_STOP, FINISH_LENGTH] and segments.tolist() == [2, 3]


def test_one_segment_is_the_uncut_call():
    eng = ScriptedEngine(eos_at={5: 4})
    ids, mask = _prompts([[5, 6], [7]])
    params = SamplingParams(max_new_tokens=4, temperature=1.0, seed=9)
    gen, versions, segments = generate_in_segments(eng, ids, mask, params, segment_tokens=4, pad_id=0)
    assert gen.responses.tolist() == [[2, 3, EOS, 0], [1, 2, 3, 4]]
    assert versions.tolist() == [[0, 0, 0, 0], [0, 0, 0, 0]] and segments.tolist() == [1, 1]
    assert segment_seed(9, 0) == 9 and segment_seed(9, 1) != 9 and segment_seed(None, 3) is None


def test_partial_samples_budgets_and_inputs():
    state = PartialSamples.start(*_prompts([[3, 4], [5]]), limits=[5, 2], segment_tokens=3)
    state.tokens = [[7, 8], [9]]
    assert state.budgets([0, 1]) == [3, 1]
    ids, mask = state.inputs([0, 1], pad_id=0)
    assert ids.tolist() == [[3, 4, 7, 8], [0, 0, 5, 9]] and mask.tolist() == [[1, 1, 1, 1], [0, 0, 1, 1]]


def _greedy(max_new: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, temperature=0.0, seed=5)


def test_fast_engine_continues_a_prefix_exactly():
    ids, mask = left_padded([3, 9, 6, 1])
    whole = engine(tiny_model("llama"), None).generate(ids, mask, _greedy(7))
    seg_engine = engine(tiny_model("llama"), None)
    gen, versions, segments = generate_in_segments(seg_engine, ids, mask, _greedy(7), segment_tokens=3, pad_id=0)
    assert segments.tolist() == [3, 3, 3, 3]  # 7 tokens in segments of 3: 3 + 3 + 1
    assert torch.equal(gen.responses, whole.responses) and torch.equal(gen.response_mask.long(),
                                                                       whole.response_mask.long())
    torch.testing.assert_close(gen.logprobs, whole.logprobs.float(), rtol=1e-4, atol=1e-4)


def test_hf_engine_continues_a_prefix_exactly():
    tok = build_tiny_tokenizer()
    texts = [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=False)
             for c in ("copy a b c", "add 1 2", "copy d")]
    enc = tok(texts, padding=True, return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    whole = HFRolloutEngine(build_tiny_model(tok), tok).generate(ids, mask, _greedy(6))
    gen, _, segments = generate_in_segments(HFRolloutEngine(build_tiny_model(tok), tok), ids, mask, _greedy(6),
                                            segment_tokens=2, pad_id=tok.pad_token_id)
    assert max(segments.tolist()) > 1  # something was continued
    assert torch.equal(gen.responses, whole.responses) and gen.finish_reasons == whole.finish_reasons
    torch.testing.assert_close(gen.logprobs, whole.logprobs.float(), rtol=1e-4, atol=1e-4)
