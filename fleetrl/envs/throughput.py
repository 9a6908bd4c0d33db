"""`fixed_turns`: an environment for measuring multi-turn throughput, not for learning anything.

A random-init model never writes a tool call, so a tool environment would end every episode after one turn and
the multi-turn path would go unmeasured. This one ignores what the model writes: every turn (which ends at the
per-turn length cap, EOS or a stop string) gets the same observation of `observation_words` words, for `turns`
model turns; the last step ends the episode. bench/multiturn.py runs it through the trainer.

Its reward is a deterministic hash of the episode's actions in [0, 1): samples of a group get different scores,
so GRPO's advantages are non-zero and the update does the same work as in a real run.
"""
from __future__ import annotations

import hashlib
import time

from fleetrl.envs.base import INFO_TOOL_CALLS, INFO_TOOL_TIME, EnvError, StepResult, register_env


@register_env("fixed_turns")
class FixedTurnsEnv:
    """`turns`: model turns per episode (set rollout.env.max_turns >= turns); `observation_words`: words of each
    observation (`word` repeated; a common short word is one token in most tokenizers, the rollout counts the
    real number as env tokens); `latency_s`: seconds each step sleeps, standing in for a tool's reply time."""

    def __init__(self, turns: int = 4, observation_words: int = 64, word: str = "a", latency_s: float = 0.0) -> None:
        if turns < 1 or observation_words < 0 or latency_s < 0 or not word.strip() or " " in word.strip():
            raise EnvError(f"fixed_turns: need turns >= 1, observation_words >= 0, latency_s >= 0 and one word; got "
                           f"turns={turns}, observation_words={observation_words}, latency_s={latency_s}, "
                           f"word={word!r}")
        self.turns, self.latency_s = turns, latency_s
        self.observation = " ".join([word.strip()] * observation_words)
        self._actions: list[str] = []

    def reset(self, sample: dict) -> None:
        self._actions = []

    def step(self, action: str) -> StepResult:
        start = time.monotonic()
        if self.latency_s:
            time.sleep(self.latency_s)
        self._actions.append(action)
        seconds = time.monotonic() - start
        if len(self._actions) < self.turns:  # an observation stands for a tool's reply: counted as one call
            return StepResult(self.observation, 0.0, False, {INFO_TOOL_CALLS: 1, INFO_TOOL_TIME: seconds})
        digest = hashlib.sha256("\x1f".join(self._actions).encode()).digest()
        return StepResult(None, int.from_bytes(digest[:8], "big") / 2.0**64, True, {INFO_TOOL_TIME: seconds})
