"""Environment episodes on a rollout worker: `run_multiturn` over a Batch, and the Batch the trainer reads back.

What comes back, beside the single-turn keys (responses, response_mask, rollout_logprobs, finish_reason):
  response_mask  1 on every trajectory token, model or environment: the forward passes attend to all of them
  loss_mask      1 on model tokens only: the policy loss, KL, entropy, advantages and the value loss read it
                 (Plan.loss_mask), so environment tokens are context with zero weight
  env_reward     [B] the episode's summed step rewards (the trainer's scores: rewards.* scorers are not used)
  env_*          [B] per-episode counters (EPISODE_COUNTERS), reduced to batch means by trainer/metrics.py
"""
from __future__ import annotations

from dataclasses import asdict

import torch

from fleetrl.batch import Batch
from fleetrl.config.schema import EnvConfig, RolloutConfig
from fleetrl.engines.protocol import FINISH_LENGTH, RolloutEngine, SamplingParams
from fleetrl.envs.base import env_factory
from fleetrl.envs.multiturn import FINISH_BUDGET, MultiTurnConfig, run_multiturn

# What `reset(sample)` receives from each row (the data layer's per-sample fields).
SAMPLE_FIELDS = ("data_source", "ground_truth", "extra_info", "raw_prompt")
# EpisodeMetrics fields shipped per sample as `env_<name>` tensors.
EPISODE_COUNTERS = ("turns", "tool_calls", "tool_errors", "tool_time_s", "timeouts", "env_errors",
                    "model_tokens", "env_tokens", "env_wait_s")


def generate_keys(rollout: RolloutConfig) -> tuple[str, ...]:
    """What the controller ships to a rollout worker per sample: the prompt, and for an environment's reset
    also the sample's fields."""
    return ("prompts", "prompt_mask", *(SAMPLE_FIELDS if rollout.env is not None else ()))


class EpisodeRunner:
    """Plays one episode per row with a fresh environment each (built by `env_factory`, checked at config
    time already, so a failure here is a worker-side difference such as a relative file path)."""

    def __init__(self, cfg: EnvConfig) -> None:
        self.make_env = env_factory(cfg.name, **cfg.kwargs)
        self.cfg = cfg

    def play(self, engine: RolloutEngine, tokenizer, batch: Batch, params: SamplingParams) -> Batch:
        """batch: prompts/prompt_mask [B, P] left-padded plus the SAMPLE_FIELDS it holds."""
        samples = [{k: batch[k][b] for k in SAMPLE_FIELDS if k in batch} for b in range(len(batch))]
        config = MultiTurnConfig(max_turns=self.cfg.max_turns, max_total_tokens=self.cfg.max_total_tokens,
                                 max_tokens_per_turn=self.cfg.max_tokens_per_turn, env_timeout_s=self.cfg.timeout_s)
        out = run_multiturn(engine, tokenizer, self.make_env, batch["prompts"], batch["prompt_mask"], samples,
                            params, config)
        tensors = {"responses": out.responses, "response_mask": out.attention_mask, "loss_mask": out.loss_mask,
                   "rollout_logprobs": out.logprobs, "env_reward": out.rewards}
        if out.responses.shape[1] == 0:  # every reset failed: one padding column keeps the [B, R] shapes valid
            tensors = {k: (v if v.dim() == 1 else torch.zeros((len(batch), 1), dtype=v.dtype))
                       for k, v in tensors.items()}
            tensors["responses"].fill_(tokenizer.pad_token_id)
        rows = [asdict(e) for e in out.episodes]
        for name in EPISODE_COUNTERS:
            tensors[f"env_{name}"] = torch.tensor([float(r[name]) for r in rows])
        # An episode cut by the token budget is what a single-turn "length" finish is (overlong masking,
        # clip ratio); the other reasons keep their multi-turn names.
        finish = [FINISH_LENGTH if f == FINISH_BUDGET else f for f in out.finish_reasons]
        return Batch(tensors, {"finish_reason": finish})
