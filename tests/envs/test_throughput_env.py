"""`fixed_turns` (the multi-turn throughput environment) and the engine-idle counter env_wait_s."""
import pytest
import torch

from fleetrl.engines.protocol import FINISH_LENGTH, GenerationOutput, SamplingParams
from fleetrl.envs.base import EnvError, env_factory
from fleetrl.envs.multiturn import MultiTurnConfig, run_multiturn
from fleetrl.envs.throughput import FixedTurnsEnv
from fleetrl.models.hf import load_tokenizer

A_ = 14  # the tiny vocabulary's "a": 4 specials, 10 digits, then a-z


class CapEngine:
    """A random-init model's turn: every row writes `width` copies of token 5 and stops at the length cap."""

    def __init__(self, width: int) -> None:
        self.width, self.weights_version, self.calls = width, 0, 0

    def generate(self, prompts: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams) -> GenerationOutput:
        self.calls += 1
        B, n = prompts.shape[0], min(self.width, params.max_new_tokens)
        return GenerationOutput(torch.full((B, n), 5), torch.ones((B, n), dtype=torch.long), torch.zeros((B, n)),
                                [FINISH_LENGTH] * B)


def test_fixed_turns_answers_every_turn_then_ends_with_a_deterministic_reward():
    env = FixedTurnsEnv(turns=3, observation_words=2)
    env.reset({})
    first, second = env.step("x y"), env.step("z")
    assert (first.observation, first.done, first.reward, first.info["tool_calls"]) == ("a a", False, 0.0, 1)
    assert (second.observation, second.done) == ("a a", False)
    last = env.step("w")
    assert last.done and last.observation is None and "tool_calls" not in last.info
    again = FixedTurnsEnv(turns=3, observation_words=2)
    again.reset({})
    rewards = [again.step(a).reward for a in ("x y", "z", "w")]
    assert rewards[-1] == last.reward and 0.0 <= last.reward < 1.0  # same actions, same reward
    other = FixedTurnsEnv(turns=3, observation_words=2)
    other.reset({})
    assert [other.step(a).reward for a in ("x y", "z", "v")][-1] != last.reward  # another last action


def test_fixed_turns_rejects_bad_settings_with_the_values():
    with pytest.raises(EnvError, match="turns=0"):
        env_factory("fixed_turns", turns=0)
    with pytest.raises(EnvError, match="word='a b'"):
        FixedTurnsEnv(word="a b")


def test_episodes_run_all_turns_and_count_model_and_environment_tokens():
    tokenizer = load_tokenizer("tiny:")
    enc = tokenizer(["user : x assistant :"] * 2, return_tensors="pt", add_special_tokens=False)
    engine = CapEngine(width=2)
    out = run_multiturn(engine, tokenizer, env_factory("fixed_turns", turns=3, observation_words=2),
                        enc["input_ids"], enc["attention_mask"], [{}, {}], SamplingParams(max_new_tokens=2),
                        MultiTurnConfig(max_turns=3, max_total_tokens=64))
    # Per episode: 3 turns of 2 model tokens; 2 observations " tool : a a assistant :" of 6 tokens each
    # (the tiny template closes nothing after an assistant message; "tool" is <unk>).
    assert engine.calls == 3 and out.finish_reasons == ["done", "done"]
    for ep in out.episodes:
        assert (ep.turns, ep.tool_calls, ep.model_tokens, ep.env_tokens) == (3, 2, 6, 12)
    assert out.responses[0, 2:8].tolist() == [2, 48, A_, A_, 50, 48]  # <unk> : a a assistant :
    assert out.loss_mask[0].tolist() == [1, 1] + [0] * 6 + [1, 1] + [0] * 6 + [1, 1]


def test_env_wait_counts_each_turn_an_episode_waited_for_replies():
    # Row 0 ends after 1 turn, row 1 after 3; every step sleeps 0.05 s. Row 1 waited for the same first step as
    # row 0 and then for two more steps, each at least 0.05 s: its wait exceeds row 0's by >= 0.1 s, and it is
    # the engine's idle time (row 1 took part in every turn).
    tokenizer = load_tokenizer("tiny:")
    enc = tokenizer(["user : x assistant :"] * 2, return_tensors="pt", add_special_tokens=False)
    envs = [FixedTurnsEnv(turns=t, observation_words=1, latency_s=0.05) for t in (1, 3)]
    out = run_multiturn(CapEngine(width=1), tokenizer, lambda s: envs[s["row"]], enc["input_ids"],
                        enc["attention_mask"], [{"row": 0}, {"row": 1}], SamplingParams(max_new_tokens=1),
                        MultiTurnConfig(max_turns=3, max_total_tokens=64))
    short, long = out.episodes
    assert (short.turns, long.turns) == (1, 3)
    assert short.env_wait_s >= 0.05 and long.env_wait_s - short.env_wait_s >= 0.1
    assert out.metrics()["env/env_wait_s"] == pytest.approx((short.env_wait_s + long.env_wait_s) / 2)
