"""The typed messages that cross from the controller to a worker (and the metrics that come back).

A decision is made once — mostly in the Plan — and carried here as a field the worker reads; workers never
re-derive it from which tensors a Batch happens to hold. `Batch.meta` carries diagnostics only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Literal, Mapping, Sequence, TypeVar

import torch

from fleetrl.config.frozen import FrozenDict

T = TypeVar("T")
OldLogprobs = Literal["recomputed", "current"]
LossMask = Literal["response_mask", "loss_mask"]


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
    segment_tokens: int | None = None
    """trainer.partial_rollouts: decode in segments of this many new tokens per sample, installing the newest
    published weights between segments (workers/partial.py); None = one engine call for the whole generation."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MiniBatchCounts:
    """GLOBAL counts of one mini-batch (over every data-parallel rank), so each rank normalises its loss as the
    full batch would and the ranks' gradients add up to the full-batch gradient (algo.aggregate)."""
    num_tokens: float
    num_seqs: float
    norm_len: float
    """The constant length of seq-mean-token-sum-norm (Dr.GRPO): rollout.max_new_tokens."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CorrectionSpec:
    """algorithm.rollout_correction applied inside the actor loss (algo/correction.py): the weights
    pi_old / pi_rollout come from the loss forward's own detached log-probs against the batch's
    `rollout_logprobs`, over the loss mask's tokens. Exact only when that forward IS the proximal policy (one
    optimiser step per batch: UpdateSpec.old_logprobs == "current"); sequence level needs whole samples in a
    micro-batch, which both micro-batch layouts guarantee (workers/layout.py)."""
    mode: str
    level: Literal["token", "sequence"]
    cap: float
    low: float
    high: float


@dataclass(frozen=True, kw_only=True, slots=True)
class UpdateSpec:
    """One role's update over this rank's share of every mini-batch (in mini-batch order, see workers/layout.py)."""
    minis: tuple[MiniBatchCounts, ...]
    kl_coef: float
    old_logprobs: OldLogprobs
    """recomputed: the batch's `old_logprobs` from the pass before the update; current: fully on-policy, the
    update's own forward, detached (ratio exactly 1)."""
    is_weights: bool = False
    """Multiply the per-token policy loss by the batch's `is_weights` (rollout-mismatch correction computed on
    the controller from recomputed log-probs)."""
    correction: CorrectionSpec | None = None
    """The same correction computed in the loss instead (no recompute pass; needs old_logprobs == "current")."""
    loss_mask: LossMask = "response_mask"
    """Which mask weighs the loss: `loss_mask` leaves truncated responses out (algorithm.overlong.mask_truncated);
    the forward pass always uses response_mask."""

    def __post_init__(self) -> None:
        assert self.correction is None or (self.old_logprobs == "current" and not self.is_weights), \
            "an in-loss correction needs the update's own log-probs as the old ones, and replaces is_weights"


@dataclass(frozen=True, slots=True)
class Extreme:
    """A loss metric combined by max or min (over micro-batches, optimiser steps and ranks), not summed as a share
    of a mean: e.g. the largest importance ratio of the step."""
    value: float | torch.Tensor
    """A float, or (inside a worker's update, until run_update reads it back) a 0-dim device tensor: the update
    reads its metrics back once, not once per micro-batch (every read waits for the GPU to drain)."""
    op: Literal["max", "min"]

    def combine(self, other: "Extreme") -> "Extreme":
        assert self.op == other.op, f"one metric combined by both {self.op} and {other.op}"
        if isinstance(self.value, torch.Tensor) or isinstance(other.value, torch.Tensor):
            pick = torch.maximum if self.op == "max" else torch.minimum
            return Extreme(pick(torch.as_tensor(self.value), torch.as_tensor(other.value)), self.op)
        return Extreme((max if self.op == "max" else min)(self.value, other.value), self.op)


@dataclass(frozen=True, kw_only=True, slots=True)
class UpdateMetrics:
    """What one rank's update returns. `shares` are this rank's shares of global means (they add over ranks);
    `same` are equal on every rank (after the gradient all-reduce: grad norm, lr, skipped updates)."""
    shares: Mapping[str, float]
    same: Mapping[str, float]
    extremes: Mapping[str, Extreme] = field(default_factory=FrozenDict)
    """Max / min metrics; a rank whose tokens gave no value for one (e.g. no valid token) leaves it out."""

    @staticmethod
    def reduce(per_rank: Sequence["UpdateMetrics"]) -> dict[str, float]:
        # a share only some ranks report (e.g. nonfinite_loss) counts 0 on the others
        keys = dict.fromkeys(k for m in per_rank for k in m.shares)
        out = {k: float(sum(m.shares.get(k, 0.0) for m in per_rank)) for k in keys}
        out.update(per_rank[0].same)
        out.update({k: v.value for k, v in combine_extremes(m.extremes for m in per_rank).items()})
        return out

    @staticmethod
    def reduce_roles(per_role: Sequence[Sequence["UpdateMetrics"]]) -> dict[str, float]:
        """`reduce` of each role's ranks; an extreme that several roles report under one name (the workers' memory
        peaks, workers/memory.py) is combined over all of them rather than taken from the last role."""
        out: dict[str, float] = {}
        for per_rank in per_role:
            out.update(UpdateMetrics.reduce(per_rank))
        out.update({k: v.value for k, v in combine_extremes(m.extremes for r in per_role for m in r).items()})
        return out

    def with_extremes(self, extra: Mapping[str, Extreme]) -> "UpdateMetrics":
        """A copy with `extra` added to the extremes (a name already there is replaced)."""
        return UpdateMetrics(shares=self.shares, same=self.same, extremes=FrozenDict({**self.extremes, **extra}))

    @classmethod
    def of(cls, shares: Mapping[str, float], same: Mapping[str, float],
           extremes: Mapping[str, Extreme] | None = None) -> "UpdateMetrics":
        return cls(shares=FrozenDict(shares), same=FrozenDict(same), extremes=FrozenDict(extremes or {}))


def combine_extremes(parts: Iterable[Mapping[str, Extreme]]) -> dict[str, Extreme]:
    """Each name's max (or min) over the parts that have it."""
    return _by_name(parts, Extreme.combine)


def _by_name(parts: Iterable[Mapping[str, T]], join: Callable[[T, T], T]) -> dict[str, T]:
    """The parts' values joined name by name, a name kept from the parts that have it."""
    out: dict[str, T] = {}
    for part in parts:
        for k, v in part.items():
            out[k] = v if k not in out else join(out[k], v)
    return out


# ------------------------------------------------------------------ the rank-local step (workers/local_step.py)
@dataclass(frozen=True, slots=True)
class Moments:
    """Count, sum, sum of squares, max and min of a set of numbers: what a rank reports of its share so that the
    controller gets the global mean, std, max and min of the step without the numbers themselves."""
    n: float = 0.0
    total: float = 0.0
    squares: float = 0.0
    high: float = float("-inf")
    low: float = float("inf")

    @staticmethod
    def of(values: torch.Tensor, mask: torch.Tensor | None = None) -> "Moments":
        """Of `values` (any shape), or of its entries where `mask` is 1."""
        v = values.detach().double().flatten()
        if mask is not None:
            v = v[mask.flatten().bool()]
        if not v.numel():
            return Moments()
        return Moments(n=float(v.numel()), total=float(v.sum()), squares=float((v * v).sum()), high=float(v.max()),
                       low=float(v.min()))

    def merge(self, other: "Moments") -> "Moments":
        return Moments(n=self.n + other.n, total=self.total + other.total, squares=self.squares + other.squares,
                       high=max(self.high, other.high), low=min(self.low, other.low))

    @property
    def mean(self) -> float:
        return self.total / self.n if self.n else 0.0

    @property
    def std(self) -> float:
        """Population std (numpy's default), as the single-batch metrics report it."""
        return max(self.squares / self.n - self.mean ** 2, 0.0) ** 0.5 if self.n else 0.0


def merge_moments(parts: Iterable[Mapping[str, Moments]]) -> dict[str, Moments]:
    """Each name's moments over the parts (ranks) that report it."""
    return _by_name(parts, Moments.merge)


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutReport:
    """One rank's rollout (generate + score) of its groups, as scalars; the samples stay in the worker."""
    moments: Mapping[str, Moments]
    """reward, reward/<data_source>, response_length, clipped (1 = stopped by the length limit), prompt_length."""
    counters: Mapping[str, float]
    """Counts that add over ranks: reward_errors, reward_timeouts, reward_skipped."""
    tokens: float
    """Prompt + response tokens of this rank's samples (throughput)."""
    timing: Mapping[str, float]
    """Parts of the phase timed inside the worker (generate/*, score)."""
    memory: Mapping[str, float] = field(default_factory=dict)
    """This process's memory peaks over the rollout phase (memory/generate/*_gib, workers/memory.py); the update
    report's peaks then cover what follows it (log-probs and the update)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PrepareRequest:
    """Log-probs, reference, values and advantages of the groups a rank holds."""
    kl_coef: float
    """The KL controller's coefficient before this step's update of it (as the single-batch path uses it)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PrepareReport:
    moments: Mapping[str, Moments]
    """entropy and logprob_diff (recompute pass, over action tokens), advantage (over action tokens), and the
    rollout-correction statistics' inputs where they run here."""
    kl: tuple[float, float] | None
    """The KL's masked sum and token count over this rank's samples (with a reference)."""
    correction: Mapping[str, float]
    """rollout_is/* statistics of this rank's share, weighted by `action_tokens` when combined."""
    action_tokens: float
    mini_tokens: Mapping[str, tuple[float, ...]]
    """Per loss-mask key, this rank's tokens in each of its mini-batch shares (the controller adds them into the
    global counts of UpdateSpec.minis)."""
