"""The step's math between generation and the update, in one copy for the two places a step's data can live:
the controller (the driver path, for plans whose roles live in different pools) and each rank of a colocated
plan (the rank-local step, workers/local_step.py). One copy, so both paths give the same numbers; the golden
per-step losses run the rank-local one.

On a rank the batch is that rank's whole groups (batch.py GroupPartition): group statistics (GRPO, RLOO, ...)
are local and exact, and the few batch-wide numbers (whitening, KL) come from all-reduced sums (`sum_all`).
"""
from __future__ import annotations

from typing import Callable

import torch

from fleetrl.algo import (
    ADVANTAGES,
    AdvantageInputs,
    apply_kl_penalty,
    fold_kl_into_scores,
    kl_estimate,
    mask_truncated,
    masked_sum,
    overlong_penalty,
    rollout_correction,
)
from fleetrl.batch import Batch
from fleetrl.config.plan import Plan
from fleetrl.workers.messages import CorrectionSpec, MiniBatchCounts, UpdateSpec

SEQ_KEYS = ("prompts", "prompt_mask", "responses", "response_mask", "group")
SumAll = Callable[[torch.Tensor], torch.Tensor]


def shape_scores(batch: Batch, scores: torch.Tensor, stats: dict[str, float], plan: Plan) -> torch.Tensor:
    """The score every later phase sees: the reward plus DAPO's soft overlong punishment when it is on (its mean
    goes into `stats`)."""
    o, r = plan.config.algorithm.overlong, plan.config.rollout
    if not o.buffer:
        return scores
    penalty = overlong_penalty(batch["response_mask"].sum(1), max_len=r.max_new_tokens, buffer=o.buffer,
                               factor=o.factor)
    stats["overlong_penalty_mean"] = float(penalty.mean())
    return scores + penalty


def after_logprobs(batch: Batch, plan: Plan) -> Batch:
    """With the log-probs in hand: the rollout-mismatch weights when the Plan computes them here (not in the loss;
    their statistics into meta["correction"]), and the loss mask that leaves truncated responses out."""
    cfg = plan.config
    if plan.correction_on_controller:
        c = cfg.algorithm.rollout_correction
        w, stats = rollout_correction(batch["old_logprobs"], batch["rollout_logprobs"], batch[plan.action_mask],
                                      mode=c.mode, level=c.level, cap=c.cap, low=c.low, high=c.high)
        batch.tensors["is_weights"] = w
        batch.meta["correction"] = {k: float(v) for k, v in stats.items()}
    if cfg.algorithm.overlong.mask_truncated:
        truncated = torch.tensor([f == "length" for f in batch["finish_reason"]])
        batch.tensors["loss_mask"] = mask_truncated(batch[plan.action_mask], truncated)
    return batch


def with_advantages(batch: Batch, plan: Plan, kl_coef: float,
                    sum_all: SumAll | None = None) -> tuple[Batch, tuple[float, float] | None]:
    """The batch with `advantages` and `returns`, and (with a reference) the KL's masked sum and token count over
    this batch: the controller's KL controller reads their global ratio. `kl_coef`: the controller's current
    coefficient (the penalty uses it before the controller updates)."""
    algo = plan.config.algorithm
    mask = batch[plan.action_mask].float()
    scores, token_rewards, kl_sums = batch["scores"], None, None
    if plan.use_ref:
        # Without a recompute pass the rollout's own log-probs stand for the policy's: same weights, or (a stale
        # pipeline) KL only in the loss, where the update's forward supplies them; this number is then the KL
        # of the sampling policy (the Plan recomputes when the reward or an adaptive controller reads it).
        logp = batch["old_logprobs"] if plan.recompute_logprobs else batch["rollout_logprobs"]
        kl_bt = kl_estimate(logp, batch["ref_logprobs"], algo.kl.estimator) * mask
        kl_sums = (float(masked_sum(kl_bt, mask)), float(mask.sum()))
        if algo.kl.placement == "reward":
            token_rewards, kl = apply_kl_penalty(batch["scores"], logp, batch["ref_logprobs"], mask, kl_coef,
                                                 algo.kl.estimator)
            if plan.kl_into_score:  # an outcome estimator ignores token rewards: fold them into the score
                scores, token_rewards = fold_kl_into_scores(scores, kl, mask, kl_coef), None
    inputs = AdvantageInputs(scores_B=scores, mask_BT=mask, group_B=batch["group"], token_rewards_BT=token_rewards,
                             values_BT=batch.tensors.get("values"), gamma=algo.gamma, lam=algo.lam,
                             norm_by_std=algo.norm_adv_by_std, sum_all=sum_all)
    adv, ret = ADVANTAGES.get(algo.advantage)(inputs)
    return batch.with_tensors(advantages=adv.float(), returns=ret.float()), kl_sums


def seq_kl(kl_sum: float, tokens: float) -> float:
    """The step's mean KL per action token (masked_mean's convention: 0 when there are no tokens)."""
    return float(torch.tensor(kl_sum, dtype=torch.float32) / torch.tensor(tokens, dtype=torch.float32).clamp(min=1))


def actor_keys(plan: Plan) -> list[str]:
    """What the actor's update reads of the batch (decided by the Plan, never by which keys a batch holds)."""
    cfg = plan.config
    keys = [*SEQ_KEYS, "advantages", "rollout_logprobs"]
    keys += ["old_logprobs"] if plan.recompute_logprobs else []
    keys += ["ref_logprobs"] if cfg.algorithm.kl.placement == "loss" else []
    keys += ["is_weights"] if plan.correction_on_controller else []
    keys += ["loss_mask"] if cfg.algorithm.overlong.mask_truncated or cfg.rollout.env else []
    return keys


def critic_keys(plan: Plan) -> list[str]:
    return [*SEQ_KEYS, "values", "returns", plan.action_mask]


def update_spec(plan: Plan, role: str, minis: tuple[MiniBatchCounts, ...], kl_coef: float) -> UpdateSpec:
    """The typed message of one role's update, every number from the Plan and the mini-batches' global counts."""
    c = plan.config.algorithm.rollout_correction
    actor = role == "actor"
    return UpdateSpec(minis=minis, kl_coef=kl_coef,
                      old_logprobs="recomputed" if plan.recompute_logprobs else "current",
                      is_weights=actor and plan.correction_on_controller, loss_mask=loss_mask_key(plan, role),
                      correction=CorrectionSpec(mode=c.mode, level=c.level, cap=c.cap, low=c.low, high=c.high)
                      if actor and plan.correction_in_loss else None)


def loss_mask_key(plan: Plan, role: str) -> str:
    """The mask a role's loss is normalised over: the actor's leaves truncated responses out under
    overlong.mask_truncated."""
    return "loss_mask" if role == "actor" and plan.config.algorithm.overlong.mask_truncated else plan.action_mask
