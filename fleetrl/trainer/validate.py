"""Validation on held-out prompts: mean@k and pass@k per data_source, sampled at rollout.val_temperature."""
from __future__ import annotations

from collections import defaultdict

import numpy as np

from fleetrl.batch import Batch
from fleetrl.cluster.group import WorkerGroup
from fleetrl.config.plan import Plan
from fleetrl.rewards.scorer import RewardScorer
from fleetrl.trainer.feed import PromptFeed
from fleetrl.trainer.metrics import pass_at_k
from fleetrl.workers.episodes import generate_keys
from fleetrl.workers.messages import GenerateRequest
from fleetrl.workers.worker import Worker


def validate(rollout: WorkerGroup, feed: PromptFeed, scorer: RewardScorer, plan: Plan,
             weights_version: int) -> dict[str, float]:
    cfg = plan.config
    k = cfg.rollout.val_n
    req = GenerateRequest(purpose="validate", step=0, temperature=cfg.rollout.val_temperature,
                          min_weights_version=weights_version)
    scores_by_source: dict[str, list[list[float]]] = defaultdict(list)
    for prompts in feed.all_batches(plan.val_batch_prompts, cfg.data.val_max_prompts):
        batch = prompts.repeat_interleave(k)
        request = _pad_to_multiple(batch.pick(*generate_keys(cfg.rollout)), rollout.world_size)
        out = rollout.call_split(Worker.generate, request, req).select(range(len(batch)))
        batch = batch.update(out)
        scores, _ = scorer.score(batch)
        for ds, row in zip(prompts["data_source"], scores.view(-1, k).tolist()):
            scores_by_source[str(ds)].append(row)
    metrics: dict[str, float] = {}
    all_rows = [row for rows in scores_by_source.values() for row in rows]
    metrics["val/reward_mean"] = float(np.mean(all_rows))
    metrics[f"val/pass@{k}"] = pass_at_k(all_rows)
    for ds, rows in scores_by_source.items():
        metrics[f"val/{ds}/mean@{k}"] = float(np.mean(rows))
        metrics[f"val/{ds}/pass@{k}"] = pass_at_k(rows)
    return metrics


def _pad_to_multiple(batch: Batch, world: int) -> Batch:
    """Repeats the last sample so the batch splits evenly over rollout workers (extra outputs are dropped)."""
    extra = (-len(batch)) % world
    if not extra:
        return batch
    return batch.select(list(range(len(batch))) + [len(batch) - 1] * extra)
