"""Per-step metrics computed on the controller from a finished batch, and reduction of worker metrics."""
from __future__ import annotations

from collections import defaultdict

import numpy as np

from fleetrl.algo import masked_mean
from fleetrl.batch import Batch
from fleetrl.workers.messages import PrepareReport, RolloutReport, merge_moments


def rollout_metrics(batch: Batch, timings: dict[str, float], step_s: float, recomputed: bool,
                    action_mask: str = "response_mask") -> dict[str, float]:
    """`recomputed`: the old-logprob pass ran (Plan.recompute_logprobs), so entropy and the rollout/trainer gap are
    measured here; otherwise the on-policy update reported them under the same names. `action_mask`
    (Plan.action_mask): the model's tokens, over which entropy, the log-prob gap and advantages are averaged."""
    m: dict[str, float] = {}
    scores = batch["scores"].numpy()
    m["train/reward_mean"] = float(scores.mean())
    m["train/reward_std"] = float(scores.std())
    for ds, vals in _by_source(batch["data_source"], scores).items():
        m[f"train/reward/{ds}/mean"] = float(np.mean(vals))
        m[f"train/reward/{ds}/std"] = float(np.std(vals))
    mask = batch["response_mask"]
    lengths = mask.sum(-1).float()
    m["train/response_length_mean"] = float(lengths.mean())
    m["train/response_length_max"] = float(lengths.max())
    m["train/response_clip_ratio"] = float(np.mean([f == "length" for f in batch["finish_reason"]]))
    m["train/prompt_length_mean"] = float(batch["prompt_mask"].sum(-1).float().mean())
    fmask = batch[action_mask].float()
    if recomputed:
        m["train/entropy"] = float(masked_mean(batch["entropy"], fmask))
        diff = (batch["rollout_logprobs"] - batch["old_logprobs"]).abs() * fmask
        m["train/rollout_logprob_diff_mean"] = float(diff.sum() / fmask.sum().clamp(min=1))
        m["train/rollout_logprob_diff_max"] = float(diff.max())
    if "kl" in batch.meta:
        m["train/kl"] = float(batch.meta["kl"])
    m["train/advantage_mean"] = float(masked_mean(batch["advantages"], fmask))
    for section in ("reward_stats", "correction", "dynamic_sampling"):  # diagnostics the phases left in meta
        for k, v in batch.meta.get(section, {}).items():
            m[f"train/{k}"] = float(v)
    if "env_reward" in batch:  # diagnostics of environment episodes (workers/episodes.py)
        m.update(episode_metrics(batch))
    for k, v in timings.items():
        m[f"train/time/{k}"] = float(v)
    for k, v in batch.meta.get("timing", {}).items():  # a phase's parts, timed inside a worker (the last rank's)
        m[f"train/time/{k}"] = float(v)
    m["train/time/step"] = step_s
    tokens = float(batch["prompt_mask"].sum() + mask.sum())
    m["train/tokens_per_s"] = tokens / max(step_s, 1e-9)
    return m


def episode_metrics(batch: Batch) -> dict[str, float]:
    """Means per episode of the rollout's env_* counters, the share of environment tokens among all trajectory
    tokens, and the share of each finish reason."""
    m = {f"train/env/{name}": float(batch[f"env_{name}"].mean())
         for name in ("turns", "tool_calls", "tool_errors", "tool_time_s", "timeouts", "env_errors", "env_wait_s")}
    env, model = float(batch["env_env_tokens"].sum()), float(batch["env_model_tokens"].sum())
    m["train/env/env_token_share"] = env / max(env + model, 1.0)
    reasons = list(batch["finish_reason"])
    for reason in sorted(set(reasons)):
        m[f"train/env/finish_{reason}"] = reasons.count(reason) / len(reasons)
    return m


def _by_source(sources: np.ndarray, values: np.ndarray) -> dict[str, list[float]]:
    groups: dict[str, list[float]] = defaultdict(list)
    for s, v in zip(sources, values):
        groups[str(s)].append(float(v))
    return groups


def pass_at_k(scores_by_prompt: list[list[float]], threshold: float = 1.0) -> float:
    """Fraction of prompts with at least one sample scoring >= threshold (a success)."""
    return float(np.mean([any(s >= threshold for s in row) for row in scores_by_prompt]))


def local_metrics(rollouts: list[RolloutReport], prepares: list[PrepareReport], kl: float | None,
                  timings: dict[str, float], step_s: float, recomputed: bool) -> dict[str, float]:
    """`rollout_metrics`' names and meanings, from the rank-local step's scalar reports (workers/local_step.py):
    means and stds from the ranks' moments, counters added, correction statistics weighted by action tokens,
    and a phase part timed inside the workers taken from the slowest rank."""
    mo = merge_moments([r.moments for r in rollouts] + [p.moments for p in prepares])
    m: dict[str, float] = {"train/reward_mean": mo["reward"].mean, "train/reward_std": mo["reward"].std}
    for name in sorted(k for k in mo if k.startswith("reward/")):
        m[f"train/{name}/mean"], m[f"train/{name}/std"] = mo[name].mean, mo[name].std
    m["train/response_length_mean"] = mo["response_length"].mean
    m["train/response_length_max"] = mo["response_length"].high
    m["train/response_clip_ratio"] = mo["clipped"].mean
    m["train/prompt_length_mean"] = mo["prompt_length"].mean
    if recomputed:
        m["train/entropy"] = mo["entropy"].mean
        m["train/rollout_logprob_diff_mean"] = mo["logprob_diff"].mean
        m["train/rollout_logprob_diff_max"] = mo["logprob_diff"].high if mo["logprob_diff"].n else 0.0
    if kl is not None:
        m["train/kl"] = kl
    m["train/advantage_mean"] = mo["advantage"].mean
    for r in rollouts:
        for k, v in r.counters.items():
            m[f"train/{k}"] = m.get(f"train/{k}", 0.0) + float(v)
    if "overlong_penalty" in mo:
        m["train/overlong_penalty_mean"] = mo["overlong_penalty"].mean
    m.update(_combined_correction(prepares))
    for k, v in timings.items():
        m[f"train/time/{k}"] = float(v)
    for r in rollouts:
        for k, v in r.timing.items():
            m[f"train/time/{k}"] = max(m.get(f"train/time/{k}", 0.0), float(v))
        for k, v in r.memory.items():  # the largest rank's
            m[f"train/{k}"] = max(m.get(f"train/{k}", 0.0), float(v))
    m["train/time/step"] = step_s
    m["train/tokens_per_s"] = sum(r.tokens for r in rollouts) / max(step_s, 1e-9)
    return m


def _combined_correction(prepares: list[PrepareReport]) -> dict[str, float]:
    """rollout_is/* over the ranks: *_max by max, *_min by min, the rest weighted by each rank's action tokens."""
    total = sum(p.action_tokens for p in prepares) or 1.0
    out: dict[str, float] = {}
    for p in prepares:
        for k, v in p.correction.items():
            key = f"train/{k}"
            if k.endswith("_max"):
                out[key] = max(out.get(key, float("-inf")), v)
            elif k.endswith("_min"):
                out[key] = min(out.get(key, float("inf")), v)
            else:
                out[key] = out.get(key, 0.0) + v * p.action_tokens / total
    return out
