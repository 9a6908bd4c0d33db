"""Multi-turn rollout: the model and one environment per sample take turns until the episode ends.

Per turn, the still-running samples (and only those: finished samples never wait in a later generate call) are
sent to the engine with their whole trajectory so far as the prompt. A turn ends at EOS, a stop string (the
environments' call formats add theirs, e.g. `</tool_call>`) or the per-turn length cap. The decoded turn goes
to `env.step`; its observation is appended as tokens through the chat template (see `ObservationRenderer`)
and the next turn starts. An episode ends when the environment says done, after `max_turns` model turns, when
the total token budget is spent, or when its environment times out.

Masks over the response axis R (right-padded, the same layout as GenerationOutput):
  attention_mask  1 on every trajectory token, model or environment (the forward pass attends to both)
  loss_mask       1 on model tokens only: environment tokens are context, not actions, so log-probs, KL,
                  entropy and the policy loss must read this mask
  logprobs        the engine's sampling log-probs on model tokens, 0 on environment tokens and padding
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial

import torch
from transformers import PreTrainedTokenizerBase

from fleetrl.batch import left_pad
from fleetrl.engines.protocol import RolloutEngine, SamplingParams
from fleetrl.envs.base import (
    INFO_TOOL_CALLS,
    INFO_TOOL_ERRORS,
    INFO_TOOL_TIME,
    Env,
    EnvCaller,
    EnvError,
    StepResult,
)

FINISH_DONE = "done"            # the environment ended the episode
FINISH_MAX_TURNS = "max_turns"
FINISH_BUDGET = "budget"        # max_total_tokens reached (no room for the observation or another turn)
FINISH_TIMEOUT = "timeout"      # an environment call passed its deadline; the environment is abandoned
FINISH_ENV_ERROR = "env_error"  # reset raised, so the episode never started (empty response, reward 0)
_SENTINEL = "\x00fleetrl-sentinel\x00"


@dataclass(frozen=True, kw_only=True)
class MultiTurnConfig:
    max_turns: int = 4               # model turns per episode
    max_total_tokens: int = 512      # model + environment tokens after the prompt
    max_tokens_per_turn: int | None = None  # None: SamplingParams.max_new_tokens
    env_timeout_s: float = 60.0      # deadline of each reset/step call
    observation_role: str = "tool"   # chat role of environment messages

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_total_tokens < 1:
            raise ValueError(f"multi-turn rollout: max_turns and max_total_tokens must be >= 1, got {self}")


@dataclass
class EpisodeMetrics:
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_time_s: float = 0.0
    timeouts: int = 0
    env_errors: int = 0
    model_tokens: int = 0
    env_tokens: int = 0
    # Seconds the episode's engine slot waited on environments: resets and each of its turns' steps plus the
    # observation's tokenisation. Turns are synchronous, so an episode waits for the slowest reply of its batch;
    # the longest episode's wait is the engine's idle time (active sets only shrink from turn to turn).
    env_wait_s: float = 0.0

    @property
    def env_token_share(self) -> float:
        total = self.model_tokens + self.env_tokens
        return self.env_tokens / total if total else 0.0


@dataclass
class MultiTurnOutput:
    """responses/attention_mask/loss_mask/logprobs: [B, R] right-padded (see the module docstring);
    rewards: [B] float32, the sum of the episode's step rewards; finish_reasons: FINISH_* per sample."""

    responses: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    logprobs: torch.Tensor
    rewards: torch.Tensor
    finish_reasons: list[str]
    episodes: list[EpisodeMetrics]

    def metrics(self) -> dict[str, float]:
        """Batch means per episode, plus the share of environment tokens among all trajectory tokens."""
        n = max(len(self.episodes), 1)
        out = {f"env/{k}": sum(getattr(e, k) for e in self.episodes) / n
               for k in ("turns", "tool_calls", "tool_errors", "tool_time_s", "timeouts", "env_errors",
                         "env_wait_s")}
        env = sum(e.env_tokens for e in self.episodes)
        total = env + sum(e.model_tokens for e in self.episodes)
        out["env/env_token_share"] = env / total if total else 0.0
        for reason in sorted(set(self.finish_reasons)):
            out[f"env/finish_{reason}"] = self.finish_reasons.count(reason) / n
        return out


class ObservationRenderer:
    """Token ids appended after a model turn for an observation: the difference of the rendered conversation.

    With a fixed conversation C = [user, assistant(SENTINEL)], before = render(C) and
    after = render(C + [observation message], add_generation_prompt=True); `after` must start with `before`
    (templates that re-render earlier messages when one is added are rejected). The appended text is the
    assistant message's closing (whatever follows SENTINEL in `before`, e.g. Qwen's "<|im_end|>\\n"; its first
    special token is dropped when the model generated it itself, e.g. it stopped at <|im_end|>), followed by
    after[len(before):] (the tool message and the next generation prompt). That text is tokenised on its own:
    model tokens are kept exactly as sampled, never re-tokenised.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, role: str = "tool") -> None:
        self.tokenizer, self.role = tokenizer, role
        self._base = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _SENTINEL}]
        before = self._render(self._base, generation_prompt=False)
        self._before = before
        self._closing = before[before.rindex(_SENTINEL) + len(_SENTINEL):]
        self._special = set(tokenizer.all_special_ids)
        try:  # fail before the first generate call if the template cannot render this role at all
            self.tokens("probe", None)
        except EnvError:
            raise
        except Exception as exc:  # jinja raises anything; the message below says what to change
            raise EnvError(f"multi-turn rollout: the chat template cannot render a {role!r} message after an "
                           f"assistant message ({type(exc).__name__}: {exc}); set the observation role "
                           "(MultiTurnConfig.observation_role) to one the template accepts, e.g. 'user'") from exc

    def tokens(self, observation: str, last_model_token: int | None) -> list[int]:
        after = self._render(self._base + [{"role": self.role, "content": observation}], generation_prompt=True)
        if not after.startswith(self._before):
            raise EnvError("multi-turn rollout: the chat template re-renders earlier messages when a "
                           f"{self.role!r} message is added, so the observation cannot be appended as a suffix; "
                           "use a template whose rendering of a conversation is a prefix of its extension")
        closing = self._closing
        if last_model_token in self._special:
            # The model closed its message itself (e.g. sampled <|im_end|>): drop that token's text and any
            # whitespace the template puts before it, keep the rest (Qwen's "\n").
            generated = self.tokenizer.decode([last_model_token])
            if generated and closing.lstrip().startswith(generated):
                closing = closing.lstrip()[len(generated):]
        return self.tokenizer.encode(closing + after[len(self._before):], add_special_tokens=False)

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


@dataclass
class _Episode:
    prompt: list[int]
    env: Env | None = None  # None until made and reset, or when that failed
    tokens: list[int] = field(default_factory=list)
    loss: list[int] = field(default_factory=list)
    logp: list[float] = field(default_factory=list)
    reward: float = 0.0
    finish: str | None = None
    metrics: EpisodeMetrics = field(default_factory=EpisodeMetrics)

    def append(self, tokens: list[int], logp: list[float] | None) -> None:
        model = logp is not None
        self.tokens += tokens
        self.loss += [int(model)] * len(tokens)
        self.logp += logp if model else [0.0] * len(tokens)
        if model:
            self.metrics.model_tokens += len(tokens)
        else:
            self.metrics.env_tokens += len(tokens)


def run_multiturn(engine: RolloutEngine, tokenizer: PreTrainedTokenizerBase, make_env: Callable[[dict], Env],
                  prompts: torch.Tensor, prompt_mask: torch.Tensor, samples: Sequence[dict],
                  params: SamplingParams, config: MultiTurnConfig = MultiTurnConfig()) -> MultiTurnOutput:
    """Plays one episode per row of `prompts`/`prompt_mask` ([B, P], left-padded), with `make_env(sample)` a
    fresh environment per sample and `samples[b]` what its reset receives. See the module docstring."""
    if len(samples) != prompts.shape[0]:
        raise ValueError(f"run_multiturn: {prompts.shape[0]} prompts but {len(samples)} samples; pass one sample "
                         "dict (data_source, ground_truth, extra_info, ...) per prompt row")
    caller = EnvCaller(config.env_timeout_s)
    episodes = [_Episode(prompts[b][prompt_mask[b].bool()].tolist()) for b in range(len(samples))]
    waited = time.monotonic()
    _start(caller, make_env, episodes, samples)
    _book_wait(episodes, time.monotonic() - waited)
    stops = tuple(dict.fromkeys([*params.stop_strings, *(s for ep in episodes if ep.env is not None
                                                         for s in getattr(ep.env, "stop_strings", ()))]))
    renderer = ObservationRenderer(tokenizer, config.observation_role)
    per_turn = config.max_tokens_per_turn or params.max_new_tokens
    for turn in range(config.max_turns):
        active = [ep for ep in episodes if ep.finish is None]
        if not active:
            break
        seed = None if params.seed is None else params.seed + 7919 * turn  # fresh draws each turn
        texts, last_tokens = _generate(engine, tokenizer, active, replace(params, seed=seed, stop_strings=stops),
                                       per_turn, config.max_total_tokens)
        waited = time.monotonic()
        outcomes = caller.call_all([partial(ep.env.step, text) for ep, text in zip(active, texts)])
        for ep, outcome, last in zip(active, outcomes, last_tokens):
            observation = _apply_outcome(ep, outcome)
            if ep.finish is not None:
                continue
            if turn == config.max_turns - 1:
                ep.finish = FINISH_MAX_TURNS
                continue
            obs_tokens = renderer.tokens(observation, last)
            # The model needs room for at least one token after the observation.
            if len(ep.tokens) + len(obs_tokens) >= config.max_total_tokens:
                ep.finish = FINISH_BUDGET
                continue
            ep.append(obs_tokens, None)
        _book_wait(active, time.monotonic() - waited)
    return _collate(episodes, tokenizer.pad_token_id)


def _book_wait(episodes: list[_Episode], seconds: float) -> None:
    for ep in episodes:
        ep.metrics.env_wait_s += seconds


def _make_and_reset(make_env: Callable[[dict], Env], sample: dict) -> tuple[Env, object]:
    env = make_env(sample)
    return env, env.reset(sample)


def _start(caller: EnvCaller, make_env: Callable[[dict], Env], episodes: list[_Episode],
           samples: Sequence[dict]) -> None:
    """Builds and resets every episode's environment under the deadline (both run user code)."""
    outcomes = caller.call_all([partial(_make_and_reset, make_env, sample) for sample in samples])
    for ep, outcome in zip(episodes, outcomes):
        if outcome.error is not None:
            ep.finish = FINISH_TIMEOUT if outcome.timed_out else FINISH_ENV_ERROR
            ep.metrics.timeouts += int(outcome.timed_out)
            ep.metrics.env_errors += int(not outcome.timed_out)
            continue
        ep.env, observation = outcome.value
        if observation:
            raise EnvError(f"run_multiturn: {type(ep.env).__name__}.reset returned an initial observation "
                           f"({str(observation)[:60]!r}); prompts are rendered by the data layer before the "
                           "environment exists, so put that text into the dataset prompt and return None")


def _generate(engine: RolloutEngine, tokenizer: PreTrainedTokenizerBase, active: list[_Episode],
              params: SamplingParams, per_turn: int, budget: int) -> tuple[list[str], list[int | None]]:
    """One model turn for every active episode; appends the tokens and returns (decoded texts, last tokens)."""
    room = [budget - len(ep.tokens) for ep in active]
    contexts = [ep.prompt + ep.tokens for ep in active]
    ids, mask = left_pad(contexts, tokenizer.pad_token_id)
    out = engine.generate(ids, mask, replace(params, max_new_tokens=max(1, min(per_turn, max(room)))))
    texts, last = [], []
    for row, ep in enumerate(active):
        # A row generated past its own budget (the call's cap is the largest budget) is cut to it.
        n = min(int(out.response_mask[row].sum()), room[row])
        tokens = out.responses[row, :n].tolist()
        ep.append(tokens, out.logprobs[row, :n].float().tolist())
        ep.metrics.turns += 1
        texts.append(tokenizer.decode(tokens, skip_special_tokens=True))
        last.append(tokens[-1] if tokens else None)
    return texts, last


def _apply_outcome(ep: _Episode, outcome) -> str | None:
    """Books a step's outcome into the episode; returns the observation (None once the episode finished)."""
    if outcome.timed_out:
        ep.metrics.timeouts += 1
        ep.finish = FINISH_TIMEOUT
        return None
    result = outcome.value
    if outcome.error is None and not isinstance(result, StepResult):
        outcome = replace(outcome, error=f"step returned {type(result).__name__}, not a StepResult")
    if outcome.error is not None:
        # The environment raised: the model reads the error and the episode continues (a later step may work).
        ep.metrics.env_errors += 1
        return f"environment error: {outcome.error}"
    info = result.info
    ep.metrics.tool_calls += int(info.get(INFO_TOOL_CALLS, 0))
    ep.metrics.tool_errors += int(info.get(INFO_TOOL_ERRORS, 0))
    ep.metrics.tool_time_s += float(info.get(INFO_TOOL_TIME, 0.0))
    ep.reward += float(result.reward)
    if result.done:
        ep.finish = FINISH_DONE
        return None
    return result.observation or ""


def _collate(episodes: list[_Episode], pad_id: int) -> MultiTurnOutput:
    B, R = len(episodes), max((len(ep.tokens) for ep in episodes), default=0)
    responses = torch.full((B, R), pad_id, dtype=torch.long)
    attention, loss = torch.zeros((B, R), dtype=torch.long), torch.zeros((B, R), dtype=torch.long)
    logprobs = torch.zeros((B, R), dtype=torch.float32)
    for b, ep in enumerate(episodes):
        n = len(ep.tokens)
        if n:
            responses[b, :n] = torch.tensor(ep.tokens, dtype=torch.long)
            attention[b, :n] = 1
            loss[b, :n] = torch.tensor(ep.loss, dtype=torch.long)
            logprobs[b, :n] = torch.tensor(ep.logp, dtype=torch.float32)
    rewards = torch.tensor([ep.reward for ep in episodes], dtype=torch.float32)
    return MultiTurnOutput(responses, attention, loss, logprobs, rewards,
                           [ep.finish or FINISH_MAX_TURNS for ep in episodes], [ep.metrics for ep in episodes])
