"""trainer.stream_rollouts through real Ray workers (docs/async.md, Streamed rollouts): the rollout worker's calls
share one engine loop that takes up published weights between decode rounds; GRPO learns with max_staleness 2 to
the synchronous test's thresholds, no trained token is more than max_staleness versions behind, and the rollout
worker's loop served its calls together (fewer sessions than calls) and took up the published versions (in flight:
tests/engines/test_fast_stream.py)."""
from __future__ import annotations

import time

import pytest

from fleetrl.cluster.group import _RayWorker
from fleetrl.config import derive_plan, load_config
from fleetrl.tracking.tracker import Tracker
from fleetrl.trainer.trainer import Trainer
from tests.integration.helpers import read_metrics, val_curve
from tests.integration.test_async import SPLIT

STREAM = ("trainer.mode=async", "trainer.stream_rollouts=true", "rollout.engine=fast",
          "algorithm.rollout_correction.mode=tis")


def test_the_plan_sizes_the_loop_for_the_window():
    plan = derive_plan(load_config("examples/quickstart.yaml", [*SPLIT, *STREAM, "trainer.max_staleness=2",
                                                                 "trainer.chunk_groups=8"]))
    # (k + 1) * P / G = 3 * 32 / 8 = 12 chunks of the window on the one rollout worker, plus a load and a validation
    assert plan.pipeline.stream and plan.pipeline.stream_calls == 14
    assert plan.rollout.max_batch == 3 * 32 * 8  # every sample of the window may be in the loop
    assert plan.summary()["pipeline"]["stream_calls"] == 14


@pytest.mark.slow
def test_grpo_learns_with_staleness_two_and_streamed_rollouts(tmp_path, ray_local):
    # The synchronous GRPO budget and thresholds of test_learning.py (80 steps, < 20% -> > 80%), with chunks of 8
    # groups: four calls a step wait in the rollout worker's loop together.
    t0 = time.monotonic()
    out = tmp_path / "learn"
    out.mkdir()
    cfg = load_config("examples/quickstart.yaml", [*SPLIT, *STREAM, "trainer.total_steps=80", "trainer.val_every=20",
                                                   "trainer.max_staleness=2", "trainer.chunk_groups=8",
                                                   "tracking.console=false", "tracking.progress=false",
                                                   f"trainer.output_dir={out}"])
    trainer = Trainer(derive_plan(cfg), Tracker(out, cfg.tracking, {}, "stream"), out)
    try:
        trainer.fit()
        (stats,) = trainer.group("rollout").call_all(_RayWorker.stream_stats)
    finally:
        trainer.shutdown()
        trainer.tracker.close()
    # the loop served the calls: fewer sessions than calls (calls joined running ones), and took up the versions
    assert stats["calls"] >= 80 * 4 and stats["sessions"] < stats["calls"] and stats["installs"] > 0, stats
    records = read_metrics(out)
    curve = val_curve(records)
    assert curve[0] < 0.2, f"initial held-out success {curve[0]} should start below 20%"
    assert curve[-1] > 0.8, f"held-out success curve {curve} did not pass 80%"
    steps = [r for r in records if "train/async/token_staleness_max" in r]
    assert len(steps) == 80 and max(r["train/async/token_staleness_max"] for r in steps) <= 2
    print(f"streamed GRPO learning: {time.monotonic() - t0:.0f}s, curve {curve}, loop {stats}")
