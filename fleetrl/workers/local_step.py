"""The rank-local step of a colocated plan: each rank generates, scores, prepares (log-probs, reference, values,
advantages) and trains on its own whole groups, and keeps them in its process between the controller's calls.

Why: passing the step's samples worker -> controller -> worker cost a 4-GPU run half of each GPU (2026-11-26:
1.84 s a step against 0.90 on one GPU for the same per-GPU work), and decoding and scoring on the controller
grew with the total sample count while every GPU waited. Here the controller sends each rank the prompts of its
groups (batch.py GroupPartition, made once per step) and typed requests, and gets scalar reports back
(workers/messages.py RolloutReport, PrepareReport, UpdateMetrics). The few batch-wide numbers are sums:
whitening all-reduces three numbers inside the advantage estimator (`sum_all`), the KL controller and the loss
normalisation read the reports' sums. Group statistics need nothing global: a group never spans two ranks.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist

from fleetrl.batch import Batch
from fleetrl.workers.episodes import generate_keys
from fleetrl.workers.memory import memory_peaks
from fleetrl.workers.messages import (
    GenerateRequest,
    Moments,
    PrepareReport,
    PrepareRequest,
    RolloutReport,
    UpdateMetrics,
    UpdateSpec,
)
from fleetrl.workers.phases import (
    SEQ_KEYS,
    actor_keys,
    after_logprobs,
    critic_keys,
    loss_mask_key,
    shape_scores,
    with_advantages,
)

if TYPE_CHECKING:
    from fleetrl.rewards.scorer import RewardScorer
    from fleetrl.workers.worker import Worker


class LocalStep:
    """The groups one rank holds for the step being made; the verbs run in order rollout, prepare, update."""

    def __init__(self, worker: "Worker") -> None:
        self.worker, self.ctx = worker, worker.ctx
        self.batch: Batch | None = None
        self.scorer: "RewardScorer | None" = None

    def rollout(self, prompts: Batch, req: GenerateRequest) -> RolloutReport:
        """Generates rollout.n samples of each prompt (whole groups, ids from the controller) and scores them."""
        cfg, plan = self.ctx.cfg, self.ctx.plan
        self.batch = None  # the previous step's groups (a step that ended before its update)
        batch = prompts.repeat_interleave(cfg.rollout.n)
        batch = batch.update(self.worker.generate(batch.pick(*generate_keys(cfg.rollout), "group"), req))
        t0 = time.perf_counter()
        scores, stats = self._scorer().score(batch)
        scores = shape_scores(batch, scores, stats, plan)
        batch.tensors["scores"] = scores
        self.batch = batch
        lengths = batch["response_mask"].sum(-1)
        moments = {"reward": Moments.of(scores), "response_length": Moments.of(lengths),
                   "clipped": Moments.of(torch.tensor([f == "length" for f in batch["finish_reason"]])),
                   "prompt_length": Moments.of(batch["prompt_mask"].sum(-1))}
        sources = [str(s) for s in batch["data_source"]]
        for ds in sorted(set(sources)):
            moments[f"reward/{ds}"] = Moments.of(scores[torch.tensor([s == ds for s in sources])])
        if "overlong_penalty_mean" in stats:  # a mean of this rank's samples: weighted by them when combined
            mean = stats.pop("overlong_penalty_mean")
            moments["overlong_penalty"] = Moments(n=float(len(batch)), total=mean * len(batch))
        timing = {**batch.meta.pop("timing", {}), "score": time.perf_counter() - t0}
        # The rollout phase's own peaks (read and reset here), so a step's memory shows per phase: what generation
        # held (the engine's cache, an FSDP2 unshard) apart from what the update needs (the next report's peaks).
        memory = {name.replace("memory/", "memory/generate/", 1): e.value
                  for name, e in memory_peaks(self.ctx.device()).items()}
        return RolloutReport(moments=moments, counters=stats, timing=timing, memory=memory,
                             tokens=float(batch["prompt_mask"].sum() + lengths.sum()))

    def prepare(self, req: PrepareRequest) -> PrepareReport:
        """Log-probs (the recompute pass), reference log-probs, values and advantages of the held groups."""
        plan, w = self.ctx.plan, self.worker
        batch = self._held()
        seq = batch.pick(*SEQ_KEYS)
        if plan.recompute_logprobs:
            batch = batch.update(w.compute_logprobs(seq))
        if plan.use_ref:
            batch = batch.update(w.compute_ref_logprobs(seq))
        batch = after_logprobs(batch, plan)
        if plan.use_critic:
            batch = batch.update(w.compute_values(seq))
        batch, kl = with_advantages(batch, plan, req.kl_coef, sum_all=self._sum_all())
        self.batch = batch
        action = batch[plan.action_mask]
        moments = {"advantage": Moments.of(batch["advantages"], action)}
        if plan.recompute_logprobs:
            moments["entropy"] = Moments.of(batch["entropy"], action)
            moments["logprob_diff"] = Moments.of((batch["rollout_logprobs"] - batch["old_logprobs"]).abs(), action)
        minis = batch.chunk(plan.num_mini_batches)  # this rank's share of each mini-batch, in order
        keys = {plan.action_mask, loss_mask_key(plan, "actor")}
        return PrepareReport(moments=moments, kl=kl, correction=batch.meta.get("correction", {}),
                             action_tokens=float(action.sum()),
                             mini_tokens={k: tuple(float(m[k].sum()) for m in minis) for k in sorted(keys)})

    def update(self, role: str, spec: UpdateSpec) -> UpdateMetrics:
        plan, w = self.ctx.plan, self.worker
        if role == "critic":
            return w.update_critic(self._held().pick(*critic_keys(plan)), spec)
        batch, self.batch = self._held(), None  # the actor's update is the step's last use of its groups
        return w.update_actor(batch.pick(*actor_keys(plan)), spec)

    def close(self) -> None:
        self.batch = None
        if self.scorer is not None:
            self.scorer.close()
            self.scorer = None

    # ------------------------------------------------------------------ helpers
    def _held(self) -> Batch:
        if self.batch is None:
            raise RuntimeError(f"rank {self.ctx.rank} of pool '{self.ctx.pool}' holds no groups for this step: "
                               "prepare/update came before rollout (a controller bug, or a worker restarted "
                               "mid-step)")
        return self.batch

    def _scorer(self) -> "RewardScorer":
        """This rank's scorer: the controller's registry, deadlines and failure-rate stop, on its own samples."""
        if self.scorer is None:
            from fleetrl.rewards.scorer import RewardScorer

            self.scorer = RewardScorer(self.ctx.cfg, self.worker._need("rollout").tokenizer)
        return self.scorer

    def _sum_all(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """Sum over the pool's ranks (the process group init_dist made), or None on one rank."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return None
        device = self.ctx.device()

        def sum_all(t: torch.Tensor) -> torch.Tensor:
            t = t.to(device)
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
            return t.cpu()
        return sum_all
