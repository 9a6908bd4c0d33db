"""The typed messages that cross from the controller to a worker (and the metrics that come back).

A decision is made once — mostly in the Plan — and carried here as a field the worker reads; workers never
re-derive it from which tensors a Batch happens to hold. `Batch.meta` carries diagnostics only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping, Sequence

from fleetrl.config.frozen import FrozenDict

OldLogprobs = Literal["recomputed", "current"]


@dataclass(frozen=True, kw_only=True, slots=True)
class GenerateRequest:
    """One generate call. The worker's seed is `plan.seed(purpose, step, rank)`."""
    purpose: Literal["generate", "validate"]
    step: int
    temperature: float
    min_weights_version: int
    """The engine refuses to generate with older weights (a weight sync that did not arrive)."""
    seed_slot: int | None = None
    """Which seed of the step this call draws: None = the worker's rank (one call per worker); the async pipeline
    numbers its generate calls within a step (trainer/pipeline.py)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MiniBatchCounts:
    """GLOBAL counts of one mini-batch (over every data-parallel rank), so each rank normalises its loss as the
    full batch would and the ranks' gradients add up to the full-batch gradient (algo.aggregate)."""
    num_tokens: float
    num_seqs: float
    norm_len: float
    """The constant length of seq-mean-token-sum-norm (Dr.GRPO): rollout.max_new_tokens."""


@dataclass(frozen=True, kw_only=True, slots=True)
class UpdateSpec:
    """One role's update over this rank's share of every mini-batch (in mini-batch order, see workers/layout.py)."""
    minis: tuple[MiniBatchCounts, ...]
    kl_coef: float
    old_logprobs: OldLogprobs
    """recomputed: the batch's `old_logprobs` from the pass before the update; current: fully on-policy, the
    update's own forward, detached (ratio exactly 1)."""
    is_weights: bool = False
    """Multiply the per-token policy loss by the batch's `is_weights` (rollout-mismatch correction)."""
    loss_mask: Literal["response_mask", "loss_mask"] = "response_mask"
    """Which mask weighs the loss: `loss_mask` leaves truncated responses out (algorithm.overlong.mask_truncated);
    the forward pass always uses response_mask."""


@dataclass(frozen=True, kw_only=True, slots=True)
class UpdateMetrics:
    """What one rank's update returns. `shares` are this rank's shares of global means (they add over ranks);
    `same` are equal on every rank (after the gradient all-reduce: grad norm, lr, skipped updates)."""
    shares: Mapping[str, float]
    same: Mapping[str, float]

    @staticmethod
    def reduce(per_rank: Sequence["UpdateMetrics"]) -> dict[str, float]:
        out = {k: float(sum(m.shares[k] for m in per_rank)) for k in per_rank[0].shares}
        out.update(per_rank[0].same)
        return out

    @classmethod
    def of(cls, shares: Mapping[str, float], same: Mapping[str, float]) -> "UpdateMetrics":
        return cls(shares=FrozenDict(shares), same=FrozenDict(same))
