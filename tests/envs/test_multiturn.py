"""Multi-turn rollout with a scripted engine (masks checked position by position) and with the tiny model.

Tiny vocabulary ids (fleetrl/models/tiny.py): <pad>=0 <eos>=1 <unk>=2 <bos>=3, digits "0".."9" = 4..13,
letters a..z = 14..39, then copy=40 add=41 next=42 first=43 last=44 "="=45 "+"=46 "?"=47 ":"=48 user=49
assistant=50 system=51. "tool" is not a word of the vocabulary, so the tool role renders as <unk>=2.
"""
import time

import pytest
import torch

from fleetrl.algo.losses import kl_loss, ppo_policy_loss
from fleetrl.engines.hf import HFRolloutEngine
from fleetrl.engines.protocol import FINISH_STOP, GenerationOutput, SamplingParams
from fleetrl.envs.base import EnvError, StepResult, env_factory
from fleetrl.envs.multiturn import MultiTurnConfig, ObservationRenderer, run_multiturn
from fleetrl.models.hf import load_causal_lm, load_tokenizer
from fleetrl.models.logprobs import sequence_logprobs

EOS, UNK, COLON, Q_MARK, ASSISTANT, USER, EQ = 1, 2, 48, 47, 50, 49, 45
B_, Q_ = 15, 30  # letters b and q


def digit(d: int) -> int:
    return 4 + d


class ScriptedEngine:
    """Answers call k with script[k] (one token list per row, in the order the rows arrive), logprob -(k+1)/4
    on every token; records what each call received."""

    def __init__(self, script: list[list[list[int]]]) -> None:
        self.script, self.calls, self.weights_version = script, [], 0

    def generate(self, prompts: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams) -> GenerationOutput:
        k = len(self.calls)
        self.calls.append((prompts.clone(), prompt_mask.clone(), params))
        rows = self.script[k]
        assert len(rows) == prompts.shape[0], f"call {k}: {prompts.shape[0]} rows, script has {len(rows)}"
        R = max(len(r) for r in rows)
        out = torch.zeros((len(rows), R), dtype=torch.long)
        mask = torch.zeros((len(rows), R), dtype=torch.long)
        for i, r in enumerate(rows):
            out[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
        return GenerationOutput(out, mask, -(k + 1) / 4 * mask.float(), [FINISH_STOP] * len(rows))


def lookup_sample(key: str, table: dict[str, str], answer: str) -> dict:
    return {"data_source": "synthetic/lookup", "ground_truth": answer, "extra_info": {"lookup": table}}


def prompts_for(tokenizer, contents: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": c}], tokenize=False,
                                           add_generation_prompt=True) for c in contents]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc["input_ids"], enc["attention_mask"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("tiny:")


def lookup_episodes(tokenizer):
    # Row 0 calls the tool ("? q"), reads "7", answers "7"; row 1 answers "3" at once and is not sent again.
    prompts, mask = prompts_for(tokenizer, ["? q =", "? b ="])
    engine = ScriptedEngine([[[Q_MARK, Q_, EOS], [digit(3), EOS]], [[digit(7), EOS]]])
    samples = [lookup_sample("q", {"q": "7", "b": "1"}, "7"), lookup_sample("b", {"b": "3"}, "3")]
    out = run_multiturn(engine, tokenizer, env_factory("lookup"), prompts, mask, samples,
                        SamplingParams(max_new_tokens=8), MultiTurnConfig(max_turns=3, max_total_tokens=64))
    return out, engine, prompts


def test_lookup_episode_masks_by_hand(tokenizer):
    out, engine, prompts = lookup_episodes(tokenizer)
    assert prompts[0].tolist() == [USER, COLON, Q_MARK, Q_, EQ, ASSISTANT, COLON]
    # Observation " tool : 7 assistant :" -> <unk> : 7 assistant :
    obs = [UNK, COLON, digit(7), ASSISTANT, COLON]
    row0 = [Q_MARK, Q_, EOS, *obs, digit(7), EOS]
    assert out.responses.shape == (2, 10)
    assert out.responses[0].tolist() == row0
    assert out.responses[1].tolist() == [digit(3), EOS] + [tokenizer.pad_token_id] * 8
    assert out.loss_mask[0].tolist() == [1, 1, 1, 0, 0, 0, 0, 0, 1, 1]
    assert out.loss_mask[1].tolist() == [1, 1] + [0] * 8
    assert out.attention_mask[0].tolist() == [1] * 10
    assert out.attention_mask[1].tolist() == [1, 1] + [0] * 8
    # call 1 logprob -1/4, call 2 -2/4; environment tokens 0
    assert out.logprobs[0].tolist() == [-0.25] * 3 + [0.0] * 5 + [-0.5] * 2
    assert out.logprobs[1].tolist() == [-0.25] * 2 + [0.0] * 8
    assert out.rewards.tolist() == [1.0, 1.0]
    assert out.finish_reasons == ["done", "done"]
    # The lookup env's call stop strings ("? a" .. "? z") reach the engine.
    assert {"? a", "? q", "? z"} <= set(engine.calls[0][2].stop_strings)
    # The second generate call saw only row 0, with its whole trajectory as the prompt (7 + 8 tokens).
    second_prompts, second_mask, _ = engine.calls[1]
    assert second_prompts.tolist() == [prompts[0].tolist() + row0[:8]]
    assert second_mask.sum().item() == 15
    a, b = out.episodes
    assert (a.turns, a.tool_calls, a.tool_errors, a.model_tokens, a.env_tokens) == (2, 1, 0, 5, 5)
    assert (b.turns, b.tool_calls, b.model_tokens, b.env_tokens) == (1, 0, 2, 0)
    metrics = out.metrics()
    assert metrics["env/turns"] == 1.5  # (2 + 1) / 2
    assert metrics["env/env_token_share"] == 5 / 12  # 5 env tokens of 5 + 5 + 2


class RaisingEnv:
    def reset(self, sample):
        return None

    def step(self, action):
        raise RuntimeError("boom")


class EchoEnv:
    def reset(self, sample):
        return None

    def step(self, action):
        return StepResult("7", 0.0, False)


class SlowEnv:
    def reset(self, sample):
        return None

    def step(self, action):
        time.sleep(3)
        return StepResult(None, 1.0, True)


def test_malformed_call_raising_env_and_timeout_are_counted(tokenizer):
    prompts, mask = prompts_for(tokenizer, ["? q =", "? q =", "? q ="])
    lookup = env_factory("lookup")
    envs = [lookup, lambda s: RaisingEnv(), lambda s: SlowEnv()]
    samples = [dict(lookup_sample("q", {"q": "7"}, "7"), which=i) for i in range(3)]
    # Turn 1: row 0 writes a malformed call "? q q"; row 1's env raises; row 2's env sleeps past the deadline.
    # Turn 2: rows 0 and 1 answer "7"; row 0's env scores it, row 1's env raises again and max_turns ends it.
    engine = ScriptedEngine([[[Q_MARK, Q_, Q_, EOS], [digit(7), EOS], [digit(7), EOS]],
                             [[digit(7), EOS], [digit(7), EOS]]])
    start = time.monotonic()
    out = run_multiturn(engine, tokenizer, lambda s: envs[s["which"]](s), prompts, mask, samples,
                        SamplingParams(max_new_tokens=8),
                        MultiTurnConfig(max_turns=2, max_total_tokens=64, env_timeout_s=0.5))
    assert time.monotonic() - start < 2.5  # the sleeping env was abandoned at its 0.5 s deadline
    assert out.finish_reasons == ["done", "max_turns", "timeout"]
    assert out.rewards.tolist() == [1.0, 0.0, 0.0]
    m0, m1, m2 = out.episodes
    assert (m0.tool_calls, m0.tool_errors, m0.turns) == (1, 1, 2)
    assert (m1.env_errors, m1.turns) == (2, 2)
    assert (m2.timeouts, m2.turns) == (1, 1)
    # Row 1's error observation is environment text: loss 0 between its two model turns.
    n1 = int(out.attention_mask[1].sum())
    assert out.loss_mask[1, :2].tolist() == [1, 1] and out.loss_mask[1, n1 - 2:n1].tolist() == [1, 1]
    assert out.loss_mask[1, 2:n1 - 2].sum() == 0 and n1 > 4
    assert out.responses[2].tolist()[:2] == [digit(7), EOS] and out.attention_mask[2].sum() == 2


def test_token_budget_ends_episode_before_observation(tokenizer):
    # Budget 7: turn 1 takes 3 tokens, the observation would take 5 (3 + 5 >= 7), so the episode ends there.
    prompts, mask = prompts_for(tokenizer, ["? q ="])
    engine = ScriptedEngine([[[Q_MARK, Q_, EOS]]])
    out = run_multiturn(engine, tokenizer, env_factory("lookup"), prompts, mask,
                        [lookup_sample("q", {"q": "7"}, "7")], SamplingParams(max_new_tokens=8),
                        MultiTurnConfig(max_turns=4, max_total_tokens=7))
    assert out.finish_reasons == ["budget"]
    assert out.responses.tolist() == [[Q_MARK, Q_, EOS]]
    assert engine.calls[0][2].max_new_tokens == 7  # min(per-turn 8, budget 7)


def test_renderer_drops_the_closing_token_the_model_generated():
    tokenizer = load_tokenizer("tiny:")
    # A template that closes every message with <eos>, like Qwen's <|im_end|>.
    tokenizer.chat_template = ("{%- for m in messages -%}{{ m['role'] }} : {{ m['content'] }} <eos> {% endfor -%}"
                               "{%- if add_generation_prompt -%}assistant :{%- endif -%}")
    renderer = ObservationRenderer(tokenizer)
    tail = [UNK, COLON, digit(7), EOS, ASSISTANT, COLON]  # "tool : 7 <eos> assistant :"
    assert renderer.tokens("7", last_model_token=EOS) == tail
    assert renderer.tokens("7", last_model_token=Q_) == [EOS, *tail]  # stopped by a stop string: close it


def test_tiny_model_logprobs_match_trainer_recompute_with_env_context(tokenizer):
    # The real engine, random tiny model: whatever it samples, the rollout logprobs at model tokens must equal
    # a trainer-style forward over prompt + whole trajectory (environment tokens attended, not scored).
    torch.manual_seed(0)
    model = load_causal_lm("tiny:")
    engine = HFRolloutEngine(model, tokenizer, seed=0)
    prompts, mask = prompts_for(tokenizer, ["? q =", "? b =", "? c =", "? d ="])
    samples = [lookup_sample(k, {k: "5"}, "5") for k in "qbcd"]
    # Always answers "7" and never ends, so every row has two observations between its three turns.
    out = run_multiturn(engine, tokenizer, lambda s: EchoEnv(), prompts, mask, samples,
                        SamplingParams(max_new_tokens=3, temperature=1.0, seed=3),
                        MultiTurnConfig(max_turns=3, max_total_tokens=20))
    assert (out.loss_mask <= out.attention_mask).all()
    assert (out.logprobs[out.loss_mask == 0] == 0).all()
    with torch.no_grad():
        recomputed, _ = sequence_logprobs(model, prompts, mask, out.responses, out.attention_mask)
    model_tokens = out.loss_mask.bool()
    torch.testing.assert_close(recomputed[model_tokens], out.logprobs[model_tokens], atol=1e-5, rtol=0)
    assert out.finish_reasons == ["max_turns"] * 4
    for b, ep in enumerate(out.episodes):
        assert ep.env_tokens == 10  # two observations of 5 tokens
        assert ep.model_tokens == int(out.loss_mask[b].sum())
        assert ep.env_tokens == int(out.attention_mask[b].sum() - out.loss_mask[b].sum())


def test_env_tokens_have_zero_weight_in_policy_and_kl_losses(tokenizer):
    out, _, _ = lookup_episodes(tokenizer)
    old = out.logprobs
    logp, ref, adv = old + 0.1, old - 0.05, torch.ones_like(old)
    env = out.attention_mask.bool() & ~out.loss_mask.bool()  # row 0, positions 3..7

    def losses(mask, logp, old, ref, adv):
        policy, _ = ppo_policy_loss(logp, old, adv, mask.float())
        kl, _ = kl_loss(logp, ref, mask.float())
        return policy.item(), kl.item()

    base = losses(out.loss_mask, logp, old, ref, adv)
    # Garbage at environment positions: any weight there would move both losses.
    bumped = [t.masked_fill(env, v) for t, v in ((logp, 5.0), (old, -3.0), (ref, 7.0), (adv, -9.0))]
    assert losses(out.loss_mask, *bumped) == base
    assert losses(out.attention_mask, *bumped) != losses(out.attention_mask, logp, old, ref, adv)


def test_a_template_that_cannot_render_the_role_fails_up_front():
    tokenizer = load_tokenizer("tiny:")
    tokenizer.chat_template = ("{%- for m in messages -%}{%- if m['role'] == 'tool' -%}{{ raise_exception('no tools') }}"
                               "{%- endif -%}{{ m['content'] }} {% endfor -%}")
    with pytest.raises(EnvError, match="cannot render a 'tool' message .*no tools.*observation_role"):
        ObservationRenderer(tokenizer)


def test_a_failing_factory_or_reset_ends_only_that_episode(tokenizer):
    prompts, mask = prompts_for(tokenizer, ["? q =", "? q ="])
    samples = [dict(lookup_sample("q", {"q": "7"}, "7"), which=i) for i in range(2)]

    def make(sample):
        if sample["which"] == 1:
            raise ValueError("no env for you")
        return env_factory("lookup")(sample)

    engine = ScriptedEngine([[[digit(7), EOS]]])  # only row 0 is generated for
    out = run_multiturn(engine, tokenizer, make, prompts, mask, samples, SamplingParams(max_new_tokens=4))
    assert out.finish_reasons == ["done", "env_error"] and out.rewards.tolist() == [1.0, 0.0]
    assert out.episodes[1].env_errors == 1 and out.attention_mask[1].sum() == 0
    assert engine.calls[0][0].shape[0] == 1


class Talkative(RaisingEnv):
    def reset(self, sample):
        return "hello"


def test_reset_text_is_rejected_with_a_fix(tokenizer):
    prompts, mask = prompts_for(tokenizer, ["? q ="])
    with pytest.raises(EnvError, match="Talkative.reset returned an initial observation .*put that text into"):
        run_multiturn(ScriptedEngine([]), tokenizer, lambda s: Talkative(), prompts, mask, [{}],
                      SamplingParams(max_new_tokens=4))
