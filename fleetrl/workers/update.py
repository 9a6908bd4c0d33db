"""The one update loop of every trained role (actor and critic): epochs × mini-batches of optimiser steps."""
from __future__ import annotations

from typing import Callable

import torch

from fleetrl.batch import Batch
from fleetrl.engines.training import TrainingEngine, read_back
from fleetrl.workers.layout import rank_minis, split_micro_batches, update_micro_batches
from fleetrl.workers.messages import Extreme, MiniBatchCounts, UpdateMetrics, UpdateSpec, combine_extremes

LossFn = Callable[[Batch, MiniBatchCounts], tuple[torch.Tensor, dict[str, float | Extreme]]]


def run_update(engine: TrainingEngine, batch: Batch, spec: UpdateSpec, *, epochs: int, micro_batch_size: int,
               loss_fn: LossFn, prefix: str, micro_batch_tokens: int | None = None,
               share_prompts: bool = False) -> UpdateMetrics:
    """`batch` is this rank's share of every mini-batch in mini-batch order (workers/layout.py); `spec.minis`
    holds each mini-batch's GLOBAL counts, so losses are normalised as for the full batch.

    loss_fn returns (loss, metrics); its metrics carry their final names (the controller only adds `train/`)
    and are shares of global means (summed over micro-batches here and over ranks by the controller), or
    `Extreme`s (max / min over micro-batches and optimiser steps here, over ranks by the controller); values
    may be 0-dim device tensors, read back once per optimiser step (engine.step) and once at the end (extremes). Returns
    the means over optimiser steps, plus `{prefix}/grad_norm` and `/lr` (equal on all ranks) and the count of
    skipped (non-finite) updates. Micro-batches hold `micro_batch_size` samples, or at most `micro_batch_tokens`
    real tokens when that is set (packed forwards; a shared prompt counted once with `share_prompts`); either
    way every row of a mini-batch is in exactly one.
    """
    minis = rank_minis(batch, len(spec.minis))
    sums: dict[str, float] = {}
    extremes: dict[str, Extreme] = {}

    def summed_part(mb: Batch, counts: MiniBatchCounts) -> tuple[torch.Tensor, dict[str, float]]:
        # the engine sums what it is given; extremes are combined here instead
        loss, metrics = loss_fn(mb, counts)
        extremes.update(combine_extremes([extremes, {k: v for k, v in metrics.items() if isinstance(v, Extreme)}]))
        return loss, {k: v for k, v in metrics.items() if not isinstance(v, Extreme)}

    for _ in range(epochs):
        for mini, counts in zip(minis, spec.minis):
            metrics = engine.step(update_micro_batches(mini, micro_batch_size, micro_batch_tokens, share_prompts),
                                  lambda mb, c=counts: summed_part(mb, c),
                                  # FSDP2: a rank with fewer micro-batches than another re-cuts its rows
                                  split=lambda n, m=mini: split_micro_batches(m, n, micro_batch_tokens, share_prompts))
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v
    steps = len(spec.minis) * epochs
    same = {f"{prefix}/grad_norm": sums.pop("grad_norm") / steps, f"{prefix}/lr": sums.pop("lr") / steps,
            f"{prefix}/skipped_updates": sums.pop("skipped", 0.0)}
    if "allreduce_s" in sums:  # more than one rank: one gradient all-reduce, timed at start (the same on every rank)
        same[f"{prefix}/allreduce_s"] = sums.pop("allreduce_s") / steps
    # micro-batches whose loss was NaN/inf (their update is skipped when the gradient is too), per optimiser step;
    # reported only when there were any
    if nonfinite := sums.pop("nonfinite_loss", 0.0):
        sums[f"{prefix}/nonfinite_loss"] = nonfinite
    shares = {k: v / steps for k, v in sums.items()}
    values = read_back({k: e.value for k, e in extremes.items()})  # one transfer for all of them
    return UpdateMetrics.of(shares, same, {k: Extreme(values[k], e.op) for k, e in extremes.items()})
