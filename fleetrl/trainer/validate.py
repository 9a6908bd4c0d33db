"""Validation on held-out prompts: mean@k and pass@k per data_source, sampled at rollout.val_temperature."""
from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

import numpy as np

from fleetrl.trainer.metrics import pass_at_k
from fleetrl.workers.worker import Worker

if TYPE_CHECKING:
    from fleetrl.trainer.trainer import Trainer


def validate(trainer: "Trainer") -> dict[str, float]:
    cfg = trainer.cfg
    k = cfg.rollout.val_n
    world = trainer.plan.world["rollout"]
    scores_by_source: dict[str, list[list[float]]] = defaultdict(list)
    size = max(world, cfg.data.prompts_per_step)
    for prompts in trainer.val_feed.all_batches(size, cfg.data.val_max_prompts):
        batch = prompts.repeat_interleave(k)
        request = _pad_to_multiple(batch.pick("prompts", "prompt_mask"), world)
        request.meta.update(temperature=cfg.rollout.val_temperature, seed=cfg.trainer.seed + 7,
                            min_weights_version=trainer.weights_version)
        out = trainer.group("rollout").call_split(Worker.generate, request).select(range(len(batch)))
        batch = batch.update(out)
        scores, _ = trainer.scorer.score(batch)
        per_prompt = scores.view(-1, k).tolist()
        for ds, row in zip(prompts["data_source"], per_prompt):
            scores_by_source[str(ds)].append(row)
    metrics: dict[str, float] = {}
    all_rows = [row for rows in scores_by_source.values() for row in rows]
    metrics["val/reward_mean"] = float(np.mean(all_rows))
    metrics[f"val/pass@{k}"] = pass_at_k(all_rows)
    for ds, rows in scores_by_source.items():
        metrics[f"val/{ds}/mean@{k}"] = float(np.mean(rows))
        metrics[f"val/{ds}/pass@{k}"] = pass_at_k(rows)
    return metrics


def _pad_to_multiple(batch, world: int):
    """Repeats the last sample so the batch splits evenly over rollout workers (extra outputs are dropped)."""
    extra = (-len(batch)) % world
    if not extra:
        return batch
    return batch.select(list(range(len(batch))) + [len(batch) - 1] * extra)
