"""The controller's side of the rank-local step (Plan.rank_local; the worker's side is workers/local_step.py).

It draws the step's prompts, partitions them as whole groups over the pool's ranks once (batch.py
GroupPartition: each mini-batch's groups balanced by prompt tokens), and sends each rank its prompts and typed
requests. What comes back are scalar reports: reward and length moments, token counts per mini-batch, the KL's
sums, the update's metrics. No sample's tokens, log-probs or advantages pass through this process.
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Callable

import torch

from fleetrl.algo.kl import KLController
from fleetrl.batch import GroupPartition
from fleetrl.cluster.group import WorkerGroup
from fleetrl.config.plan import Plan
from fleetrl.trainer.feed import PromptFeed
from fleetrl.workers.messages import (
    GenerateRequest,
    MiniBatchCounts,
    PrepareReport,
    PrepareRequest,
    RolloutReport,
    UpdateMetrics,
)
from fleetrl.workers.phases import loss_mask_key, seq_kl, update_spec
from fleetrl.workers.worker import Worker


@dataclass(frozen=True, kw_only=True, slots=True)
class LocalStepReports:
    """What one rank-local step's ranks reported, for the step's metrics (trainer/metrics.py local_metrics)."""
    rollouts: list[RolloutReport]
    prepares: list[PrepareReport]
    kl: float | None
    prompts: tuple[str, ...] = ()
    """The uid of each prompt (group) the step trained, for prompts.jsonl (trainer/prompt_log.py)."""


class RankLocalStep:
    def __init__(self, plan: Plan, group: WorkerGroup, feed: PromptFeed) -> None:
        self.plan, self.group, self.feed = plan, group, feed

    def run(self, step: int, weights_version: int, kl_ctl: KLController,
            timed: Callable[[str], AbstractContextManager]) -> tuple[list[list[UpdateMetrics]], LocalStepReports]:
        """One step: rollout, prepare, update on every rank; returns the update reports (per role, per rank)."""
        cfg, plan = self.plan.config, self.plan
        prompts = self.feed.next_batch(cfg.data.prompts_per_step)
        prompts.tensors["group"] = torch.arange(len(prompts))  # a prompt is its group until it is repeated
        part = GroupPartition.of(prompts, self.group.world_size, plan.num_mini_batches)
        req = GenerateRequest(purpose="generate", step=step, temperature=cfg.rollout.temperature,
                              min_weights_version=weights_version)
        with timed("generate"):
            rollouts = self.group.call_parts(Worker.rollout_local, prompts.split_groups(part), req)
        with timed("logprobs"):
            prepares = self.group.call_all(Worker.prepare_local, PrepareRequest(kl_coef=kl_ctl.coef))
        kl = None
        if plan.use_ref:
            kl = seq_kl(sum(p.kl[0] for p in prepares), sum(p.kl[1] for p in prepares))
            kl_ctl.update(kl, plan.samples_per_step)
        updates = []
        if plan.use_critic:
            with timed("update_critic"):
                spec = update_spec(plan, "critic", self._minis(prepares, "critic"), kl_ctl.coef)
                updates.append(self.group.call_all(Worker.update_critic_local, spec))
        if plan.actor_updates_at(step):
            with timed("update_actor"):
                spec = update_spec(plan, "actor", self._minis(prepares, "actor"), kl_ctl.coef)
                updates.append(self.group.call_all(Worker.update_actor_local, spec))
        return updates, LocalStepReports(rollouts=rollouts, prepares=prepares, kl=kl,
                                         prompts=tuple(str(u) for u in prompts["uid"]))

    def _minis(self, prepares: list[PrepareReport], role: str) -> tuple[MiniBatchCounts, ...]:
        """The GLOBAL counts of each mini-batch: the ranks' token counts added (a mini-batch is the same groups
        at any world size, batch.py GroupPartition)."""
        key, plan = loss_mask_key(self.plan, role), self.plan
        per_mini = zip(*(p.mini_tokens[key] for p in prepares))
        size = float(plan.mini_batch_samples)
        return tuple(MiniBatchCounts(num_tokens=float(sum(t)), num_seqs=size,
                                     norm_len=float(plan.config.rollout.max_response_tokens)) for t in per_mini)
