"""Moments (workers/messages.py) and the rank-local step's metrics (trainer/metrics.py local_metrics): what two
ranks report of their halves gives the numbers of the whole batch."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from fleetrl.trainer.metrics import local_metrics
from fleetrl.workers.messages import Moments, PrepareReport, RolloutReport, merge_moments


def test_moments_of_halves_merge_into_the_whole():
    x = torch.tensor([1.0, 2.0, 3.0, 6.0])
    a, b = Moments.of(x[:2]), Moments.of(x[2:])
    # whole: n 4, sum 12, squares 1 + 4 + 9 + 36 = 50, mean 3, population var 50/4 - 9 = 3.5
    m = a.merge(b)
    assert (m.n, m.total, m.squares, m.high, m.low) == (4.0, 12.0, 50.0, 6.0, 1.0)
    assert m.mean == 3.0 and math.isclose(m.std, math.sqrt(3.5)) and math.isclose(m.std, float(x.std(correction=0)), rel_tol=1e-6)


def test_masked_moments_and_empty_shares():
    x = torch.tensor([[1.0, 5.0], [3.0, float("nan")]])
    mask = torch.tensor([[1, 0], [1, 0]])
    m = Moments.of(x, mask)
    assert (m.n, m.total, m.high) == (2.0, 4.0, 3.0)  # the NaN in padding is never read
    empty = Moments.of(x, torch.zeros_like(mask))
    assert empty.n == 0 and empty.mean == 0.0 and empty.merge(m) == m


def _reports(scores: list[float], lengths: list[float], source: str) -> tuple[RolloutReport, PrepareReport]:
    s, n = torch.tensor(scores), torch.tensor(lengths)
    rollout = RolloutReport(moments={"reward": Moments.of(s), f"reward/{source}": Moments.of(s),
                                     "response_length": Moments.of(n), "clipped": Moments.of(n == 4),
                                     "prompt_length": Moments.of(torch.full_like(n, 2.0))},
                            counters={"reward_errors": 1.0}, tokens=float(n.sum() + 2 * len(n)),
                            timing={"score": len(scores) * 0.1})
    prepare = PrepareReport(moments={"advantage": Moments.of(s - s.mean())}, kl=None,
                            correction={"rollout_is/ratio_max": max(scores), "rollout_is/weight_mean": 1.0},
                            action_tokens=float(n.sum()), mini_tokens={"response_mask": (float(n.sum()),)})
    return rollout, prepare


def test_two_ranks_reports_give_the_whole_batch_metrics():
    r0, p0 = _reports([1.0, 0.0], [4.0, 2.0], "a")
    r1, p1 = _reports([1.0, 1.0, 0.0], [1.0, 4.0, 3.0], "b")
    m = local_metrics([r0, r1], [p0, p1], kl=None, timings={"generate": 1.5}, step_s=2.0, recomputed=False)
    # rewards [1, 0, 1, 1, 0]: mean 0.6, population std sqrt(0.6 - 0.36) = sqrt(0.24)
    assert math.isclose(m["train/reward_mean"], 0.6) and math.isclose(m["train/reward_std"], math.sqrt(0.24))
    assert m["train/reward/a/mean"] == 0.5 and math.isclose(m["train/reward/b/mean"], 2 / 3)
    # lengths [4, 2, 1, 4, 3]: mean 2.8, max 4, clipped (= 4 here) 2 of 5
    assert math.isclose(m["train/response_length_mean"], 2.8) and m["train/response_length_max"] == 4.0
    assert math.isclose(m["train/response_clip_ratio"], 0.4)
    assert m["train/reward_errors"] == 2.0  # counters add
    assert m["train/rollout_is/ratio_max"] == 1.0  # a max by max; a mean weighted by action tokens
    assert math.isclose(m["train/rollout_is/weight_mean"], 1.0)
    assert math.isclose(m["train/time/score"], 0.3)  # the slowest rank's part
    assert m["train/time/generate"] == 1.5 and m["train/time/step"] == 2.0
    # tokens: responses 14 + prompts 2 x 5 = 24 over 2 s
    assert m["train/tokens_per_s"] == 12.0
    assert "train/kl" not in m and "train/entropy" not in m


def test_merge_moments_by_name():
    merged = merge_moments([{"a": Moments.of(torch.tensor([1.0]))}, {"a": Moments.of(torch.tensor([3.0])),
                                                                     "b": Moments.of(torch.tensor([5.0]))}])
    assert merged["a"].mean == 2.0 and merged["b"].n == 1.0


def test_the_generate_phase_memory_peak_is_the_largest_ranks():
    r0, p0 = _reports([1.0, 0.0], [3.0, 5.0], "math")
    r1, p1 = _reports([0.0, 0.0], [2.0, 2.0], "math")
    r0 = dataclasses.replace(r0, memory={"memory/generate/gpu_peak_allocated_gib": 70.5})
    r1 = dataclasses.replace(r1, memory={"memory/generate/gpu_peak_allocated_gib": 71.25})
    m = local_metrics([r0, r1], [p0, p1], kl=None, timings={}, step_s=1.0, recomputed=False)
    assert m["train/memory/generate/gpu_peak_allocated_gib"] == 71.25


@pytest.mark.slow  # a whole (one-step) run: ~12 s
def test_the_rank_local_step_reports_the_rollout_phases_peak_apart(tmp_path):
    """A whole rank-local run (in process, CPU): the rollout phase's peak is its own metric beside the update's."""
    from tests.integration.helpers import train_run

    rows = train_run("examples/quickstart.yaml", tmp_path, "trainer.total_steps=1", "trainer.val_every=0",
                     "trainer.val_before_train=false", "tracking.tensorboard=false")
    step = next(r for r in rows if "train/actor/pg_loss" in r)
    assert step["train/memory/generate/rss_peak_gib"] >= 0.01 and step["train/memory/rss_peak_gib"] >= 0.01
