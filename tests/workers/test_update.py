"""The one update loop (workers/update.py) with a real TrainingEngine around a 1-in/1-out linear model."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fleetrl.batch import Batch
from fleetrl.config.schema import OptimConfig
from fleetrl.engines.training import TrainingEngine
from fleetrl.workers.messages import Extreme, MiniBatchCounts, UpdateSpec
from fleetrl.workers.update import run_update

LR = 0.01


def _engine() -> TrainingEngine:
    model = nn.Linear(1, 1)
    return TrainingEngine(model, OptimConfig(lr=LR, grad_clip=0.0), total_optimizer_steps=100)


def _spec(num_mini: int) -> UpdateSpec:
    # Global counts as if a second rank held as many rows again: 4 sequences per mini-batch.
    minis = tuple(MiniBatchCounts(num_tokens=8.0, num_seqs=4.0, norm_len=2.0) for _ in range(num_mini))
    return UpdateSpec(minis=minis, kl_coef=0.0, old_logprobs="current")


class CountingLoss:
    """loss = sum(w·v + b) / num_seqs, so dL/dw = sum(v) / 4 and dL/db = rows / 4 whatever the weights are."""

    def __init__(self, engine: TrainingEngine) -> None:
        self.engine, self.calls = engine, 0

    def __call__(self, mb: Batch, counts: MiniBatchCounts) -> tuple[torch.Tensor, dict[str, float]]:
        self.calls += 1
        v = mb["v"]
        loss = self.engine.model(v.unsqueeze(-1)).sum() / counts.num_seqs
        return loss, {"actor/v_share": float(v.sum()) / counts.num_seqs}


def _count_steps(engine: TrainingEngine) -> list[int]:
    steps: list[int] = []
    real = engine.step

    def counted(*args, **kwargs):
        steps.append(1)
        return real(*args, **kwargs)

    engine.step = counted  # type: ignore[method-assign]
    return steps


def test_steps_are_epochs_times_mini_batches_and_metrics_are_step_means():
    engine = _engine()
    steps = _count_steps(engine)
    loss = CountingLoss(engine)
    batch = Batch({"v": torch.tensor([1.0, 2.0, 3.0, 4.0])})  # mini 0 = rows [1, 2], mini 1 = rows [3, 4]
    out = run_update(engine, batch, _spec(2), epochs=3, micro_batch_size=1, loss_fn=loss, prefix="actor")
    assert len(steps) == 3 * 2  # epochs × mini-batches optimiser steps
    assert loss.calls == 3 * 4  # every row once per epoch (micro-batches of one row)
    assert engine.scheduler.last_epoch == 6
    # v_share per step: mini 0 = (1+2)/4 = 0.75, mini 1 = (3+4)/4 = 1.75; mean over 6 steps = 3·2.5/6 = 1.25
    assert dict(out.shares) == {"actor/v_share": pytest.approx(1.25, abs=1e-12)}
    # grad (w, b): mini 0 = (3/4, 2/4) -> |g| = sqrt(0.8125); mini 1 = (7/4, 2/4) -> sqrt(3.3125); the
    # gradient does not depend on the weights, so the mean over the 6 steps is their average.
    assert set(out.same) == {"actor/grad_norm", "actor/lr", "actor/skipped_updates"}
    assert out.same["actor/grad_norm"] == pytest.approx((math.sqrt(0.8125) + math.sqrt(3.3125)) / 2, rel=1e-6)
    assert out.same["actor/lr"] == pytest.approx(LR)  # constant schedule
    assert out.same["actor/skipped_updates"] == 0.0


def test_prefix_names_only_the_engine_metrics():
    engine = _engine()
    out = run_update(engine, Batch({"v": torch.tensor([1.0, 3.0])}), _spec(1), epochs=1, micro_batch_size=2,
                     loss_fn=CountingLoss(engine), prefix="critic")
    assert set(out.same) == {"critic/grad_norm", "critic/lr", "critic/skipped_updates"}
    assert dict(out.shares) == {"actor/v_share": pytest.approx(1.0)}  # (1+3)/4: loss_fn names its own metrics
    # one step over both rows: grad (w, b) = (4/4, 2/4) -> |g| = sqrt(1.25)
    assert out.same["critic/grad_norm"] == pytest.approx(math.sqrt(1.25), rel=1e-6)


def test_non_finite_steps_are_skipped_and_counted_not_averaged():
    engine = _engine()
    before = [p.detach().clone() for p in engine.model.parameters()]
    # Every row is inf: each of the 2 epochs × 2 mini-batches steps has a non-finite gradient.
    batch = Batch({"v": torch.full((4,), math.inf)})
    out = run_update(engine, batch, _spec(2), epochs=2, micro_batch_size=2, loss_fn=CountingLoss(engine),
                     prefix="actor")
    assert out.same["actor/skipped_updates"] == 4.0  # a count over steps, not a mean
    assert all(torch.equal(a, b) for a, b in zip(before, engine.model.parameters()))



def test_returned_metrics_are_read_only():
    engine = _engine()
    out = run_update(engine, Batch({"v": torch.tensor([1.0, 3.0])}), _spec(1), epochs=1, micro_batch_size=2,
                     loss_fn=CountingLoss(engine), prefix="actor")
    with pytest.raises(TypeError, match="does not support item assignment"):
        out.shares["actor/v_share"] = 0.0  # type: ignore[index]


def test_extremes_combine_by_max_and_min_over_micro_batches_and_steps():
    engine = _engine()

    def loss(mb: Batch, counts: MiniBatchCounts):
        v = mb["v"]
        return engine.model(v.unsqueeze(-1)).sum(), {"actor/v_max": Extreme(float(v.max()), "max"),
                                                       "actor/v_min": Extreme(float(v.min()), "min")}

    # rows [5, 1 | 7, 2]: 2 mini-batches of 2 micro-batches of 1 row, 2 epochs; max 7, min 1 (not summed)
    out = run_update(engine, Batch({"v": torch.tensor([5.0, 1.0, 7.0, 2.0])}), _spec(2), epochs=2,
                     micro_batch_size=1, loss_fn=loss, prefix="actor")
    assert dict(out.shares) == {}
    assert dict(out.extremes) == {"actor/v_max": Extreme(7.0, "max"), "actor/v_min": Extreme(1.0, "min")}


def test_tensor_metrics_and_extremes_are_read_back_once_per_step_with_the_same_values():
    """A loss_fn may return 0-dim tensors (the actor does, so no micro-batch waits for the device): the
    metrics equal the float version's, and a NaN loss is counted under the role's prefix."""
    engine = _engine()
    batch = Batch({"v": torch.tensor([1.0, 2.0, 3.0, 4.0])})

    def tensor_loss(mb: Batch, counts: MiniBatchCounts):
        v = mb["v"]
        loss = engine.model(v.unsqueeze(-1)).sum() / counts.num_seqs
        return loss, {"actor/v_share": v.sum() / counts.num_seqs, "actor/v_max": Extreme(v.max(), "max")}

    out = run_update(engine, batch, _spec(2), epochs=1, micro_batch_size=1, loss_fn=tensor_loss, prefix="actor")
    assert dict(out.shares) == {"actor/v_share": pytest.approx(1.25)}  # (1+2)/4 and (3+4)/4, mean of 2 steps
    assert out.extremes["actor/v_max"] == Extreme(4.0, "max") and isinstance(out.extremes["actor/v_max"].value, float)

    engine = _engine()

    def nan_once(mb: Batch, counts: MiniBatchCounts):
        loss, m = tensor_loss(mb, counts)
        return (loss * float("nan") if float(mb["v"][0]) == 2.0 else loss), m

    out = run_update(engine, batch, _spec(2), epochs=1, micro_batch_size=1, loss_fn=nan_once, prefix="critic")
    assert out.shares["critic/nonfinite_loss"] == 0.5  # one micro-batch of 4, over 2 optimiser steps
    assert out.same["critic/skipped_updates"] == 1.0  # its step's gradient was NaN too
