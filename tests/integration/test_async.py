"""trainer.mode=async through real Ray workers: max_staleness 0 is the synchronous run, number for number; no
sample beyond the bound is ever trained on (recorded versions); dynamic sampling refills within the bound; GRPO
still learns with max_staleness 1 and TIS. (Recovery, resume, LoRA weights and packing: test_async_ops.py, a
separate module so the two halves run in parallel under pytest-xdist's --dist loadfile.)"""
from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

from fleetrl.config import derive_plan, load_config
from fleetrl.tracking.tracker import Tracker
from fleetrl.trainer.metric_names import is_machine_metric
from fleetrl.trainer.schedule import staleness_bound_holds
from fleetrl.trainer.trainer import Trainer
from tests.integration.helpers import train_run, val_curve

SPLIT = ("cluster.pools={train: {cpus_per_worker: 0.5}, gen: {cpus_per_worker: 0.5}}",
         "cluster.roles={actor: train, rollout: gen}")
SHORT = ("model.path=tiny:", "data.prompts_per_step=8", "algorithm.micro_batch_size=16", "trainer.val_every=0",
         "trainer.val_before_train=false", "actor.optim.lr=0.01")
# What differs between two runs with equal numbers: the machine metrics, the async-only diagnostics, and the
# policy check's gap, which the Plan runs on synchronous runs only (an async step's samples may mix versions).
ASYNC_ONLY = "train/async/"
SYNC_ONLY = "train/sync_check/"


def _numbers(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not (is_machine_metric(k) or k.startswith((ASYNC_ONLY, SYNC_ONLY)))}
            for r in records if "train/reward_mean" in r]


@pytest.mark.slow
def test_staleness_zero_is_the_synchronous_run(tmp_path, ray_local):
    sync_raw = train_run("examples/quickstart.yaml", tmp_path / "sync", *SHORT, *SPLIT, "trainer.total_steps=3")
    asyn_raw = train_run("examples/quickstart.yaml", tmp_path / "async", *SHORT, *SPLIT, "trainer.total_steps=3",
                         "trainer.mode=async", "trainer.max_staleness=0")
    steps = [r for r in sync_raw if "train/reward_mean" in r]
    assert all(SYNC_ONLY + "gap" in r for r in steps)  # the check ran on the synchronous run, and only there
    assert not any(k.startswith(SYNC_ONLY) for r in asyn_raw for k in r)
    sync, asyn = _numbers(sync_raw), _numbers(asyn_raw)
    assert len(sync) == len(asyn) == 3
    assert sync[0]["train/actor/pg_loss"] != sync[2]["train/actor/pg_loss"]  # the runs do move
    for step, (s, a) in enumerate(zip(sync, asyn), start=1):
        assert set(s) == set(a), f"step {step}: {sorted(set(s) ^ set(a))}"
        for key in s:
            assert s[key] == a[key] or (math.isnan(s[key]) and math.isnan(a[key])), \
                f"step {step}: {key} sync {s[key]!r} async {a[key]!r}"


def _recorded_run(tmp_path: Path, *overrides: str, batches: list | None = None) -> list[tuple[int, list[int]]]:
    """Trains and returns, per step, (the version trained, the recorded version of every sample it trained on).
    `batches`, when given, receives each step's trained batch."""
    cfg = load_config("examples/quickstart.yaml", [*SHORT, *overrides, "tracking.console=false",
                                                   "tracking.progress=false", f"trainer.output_dir={tmp_path}"])
    trainer = Trainer(derive_plan(cfg), Tracker(tmp_path, cfg.tracking, {}, "async"), tmp_path)
    seen: list[tuple[int, list[int]]] = []
    real = trainer.advantages

    def spy(batch):
        seen.append((trainer.progress.weights_version, batch["weights_version"].tolist()))
        if batches is not None:
            batches.append(batch)
        return real(batch)

    trainer.advantages = spy  # type: ignore[method-assign]
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
        trainer.tracker.close()
    return seen


@pytest.mark.slow
def test_no_sample_beyond_the_bound_is_trained_on(tmp_path, ray_local):
    # k=1, two rollout workers, 8 groups per step in chunks of 2: four generate calls per step stream back.
    seen = _recorded_run(tmp_path, "cluster.pools={train: {cpus_per_worker: 0.5}, gen: {cpus_per_worker: 0.5, "
                         "workers_per_node: 2}}", SPLIT[1], "trainer.mode=async", "trainer.max_staleness=1",
                         "trainer.chunk_groups=2", "trainer.total_steps=4")
    trained = [t for t, _ in seen]
    assert trained == [0, 1, 2, 3]  # step s trains version s-1
    assert all(len(v) == 8 * 8 for _, v in seen)  # 8 prompts × rollout.n 8, whole groups
    assert staleness_bound_holds(trained, [v for _, v in seen], 1)
    # Not vacuous: step 1 and 2 were generated at version 0 (steps 1-2 before any sync), so step 2 trains
    # version 1 on staleness-1 samples; from step 3 on, step s is generated at version s-2.
    assert [sorted(set(v)) for _, v in seen] == [[0], [0], [1], [2]]


@pytest.mark.slow
def test_dynamic_sampling_refills_from_the_stream_within_the_bound(tmp_path, ray_local):
    # Chunks of 2 groups; groups whose 8 rewards are all equal are dropped and the step takes more chunks: at
    # most max_rounds (2) x chunks_per_step (4) = 8 chunks a step.
    batches: list = []
    seen = _recorded_run(tmp_path, *SPLIT, "trainer.mode=async", "trainer.max_staleness=1", "trainer.chunk_groups=2",
                         "algorithm.dynamic_sampling.enabled=true", "algorithm.dynamic_sampling.max_rounds=2",
                         "trainer.total_steps=3", batches=batches)
    assert [t for t, _ in seen] == [0, 1, 2]
    assert all(len(v) == 8 * 8 for _, v in seen)
    assert staleness_bound_holds([t for t, _ in seen], [v for _, v in seen], 1)
    stats = [b.meta["dynamic_sampling"] for b in batches]
    # The filter ran and refilled: groups were dropped, and some step took more than its 4 chunks.
    assert sum(s["dynamic_sampling/dropped_groups"] for s in stats) > 0, stats
    assert any(4 < s["dynamic_sampling/rounds"] <= 8 for s in stats), stats
    for b, s in zip(batches, stats):  # the informative groups come first: each has scores that differ
        kept = 8 - int(s["dynamic_sampling/shortfall_groups"])
        scores = b["scores"].view(8, 8)
        assert all(len(set(scores[g].tolist())) > 1 for g in range(kept)), (s, scores)


@pytest.mark.slow
def test_grpo_learns_with_staleness_one_and_tis(tmp_path, ray_local):
    # The synchronous GRPO budget and thresholds of test_learning.py (80 steps, < 20% -> > 80%).
    t0 = time.monotonic()
    records = train_run("examples/quickstart.yaml", tmp_path / "learn", *SPLIT, "trainer.total_steps=80",
                        "trainer.val_every=20", "trainer.mode=async", "trainer.max_staleness=1",
                        "algorithm.rollout_correction.mode=tis")
    curve = val_curve(records)
    assert curve[0] < 0.2, f"initial held-out success {curve[0]} should start below 20%"
    assert curve[-1] > 0.8, f"held-out success curve {curve} did not pass 80%"
    steps = [r for r in records if "train/async/staleness_max" in r]
    assert max(r["train/async/staleness_max"] for r in steps) == 1
    assert any(r["train/rollout_is/ratio_mean"] != 1.0 for r in steps)  # the correction saw stale samples
    print(f"async GRPO learning: {time.monotonic() - t0:.0f}s, curve {curve}")
