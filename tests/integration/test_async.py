"""trainer.mode=async through real Ray workers: max_staleness 0 is the synchronous run, number for number; no
sample beyond the bound is ever trained on (recorded versions); a frozen rollout worker is a stall the supervisor
recovers from; a resume regenerates the untrained prompts; dynamic sampling refills within the bound; the
object-store weight path delivers LoRA weights; GRPO still learns with max_staleness 1 and TIS."""
from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch

from fleetrl.config import derive_plan, load_config
from fleetrl.tracking.tracker import Tracker
from fleetrl.trainer.schedule import staleness_bound_holds
from fleetrl.trainer.trainer import SEQ_KEYS, Trainer
from fleetrl.workers.worker import Worker
from tests.integration.helpers import train_run, val_curve

SPLIT = ("cluster.pools={train: {cpus_per_worker: 0.5}, gen: {cpus_per_worker: 0.5}}",
         "cluster.roles={actor: train, rollout: gen}")
SHORT = ("model.path=tiny:", "data.prompts_per_step=8", "algorithm.micro_batch_size=16", "trainer.val_every=0",
         "trainer.val_before_train=false", "actor.optim.lr=0.01")
# What differs between two runs with equal numbers: wall-clock times, and the async-only diagnostics.
TIMING = ("train/time/", "train/tokens_per_s", "train/async/")


def _numbers(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in records
            if "train/reward_mean" in r]


@pytest.mark.slow
def test_staleness_zero_is_the_synchronous_run(tmp_path, ray_local):
    sync = _numbers(train_run("examples/quickstart.yaml", tmp_path / "sync", *SHORT, *SPLIT, "trainer.total_steps=3"))
    asyn = _numbers(train_run("examples/quickstart.yaml", tmp_path / "async", *SHORT, *SPLIT, "trainer.total_steps=3",
                              "trainer.mode=async", "trainer.max_staleness=0"))
    assert len(sync) == len(asyn) == 3
    assert sync[0]["train/actor/pg_loss"] != sync[2]["train/actor/pg_loss"]  # the runs do move
    for step, (s, a) in enumerate(zip(sync, asyn), start=1):
        assert set(s) == set(a), f"step {step}: {sorted(set(s) ^ set(a))}"
        for key in s:
            assert s[key] == a[key] or (math.isnan(s[key]) and math.isnan(a[key])), \
                f"step {step}: {key} sync {s[key]!r} async {a[key]!r}"


def _recorded_run(tmp_path: Path, *overrides: str) -> list[tuple[int, list[int]]]:
    """Trains and returns, per step, (the version trained, the recorded version of every sample it trained on)."""
    cfg = load_config("examples/quickstart.yaml", [*SHORT, *overrides, "tracking.console=false",
                                                   "tracking.progress=false", f"trainer.output_dir={tmp_path}"])
    trainer = Trainer(derive_plan(cfg), Tracker(tmp_path, cfg.tracking, {}, "async"), tmp_path)
    seen: list[tuple[int, list[int]]] = []
    real = trainer.advantages

    def spy(batch):
        seen.append((trainer.progress.weights_version, batch["weights_version"].tolist()))
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
    # Chunks of 2 groups; groups whose 8 rewards are all equal are dropped and the step takes more chunks.
    seen = _recorded_run(tmp_path, *SPLIT, "trainer.mode=async", "trainer.max_staleness=1", "trainer.chunk_groups=2",
                         "algorithm.dynamic_sampling.enabled=true", "algorithm.dynamic_sampling.max_rounds=2",
                         "trainer.total_steps=3")
    assert [t for t, _ in seen] == [0, 1, 2]
    assert all(len(v) == 8 * 8 for _, v in seen)
    assert staleness_bound_holds([t for t, _ in seen], [v for _, v in seen], 1)


def _rollout_vs_actor(t: Trainer) -> float:
    batch = t.generate(t.train_feed.next_batch(8))
    actor = t.group("actor").call_split(Worker.compute_logprobs, batch.pick(*SEQ_KEYS))
    return float(((batch["rollout_logprobs"] - actor["old_logprobs"]).abs() * batch["response_mask"]).max())


@pytest.mark.slow
def test_object_store_weights_reach_the_rollout_with_lora(tmp_path, ray_local):
    # LoRA: only the merged adapted projections travel; the rollout merges them into its own state dict.
    cfg = load_config("examples/quickstart.yaml", [*SHORT, *SPLIT, "trainer.mode=async", "tracking.console=false",
                                                   "actor.lora={rank: 4, targets: [q_proj, v_proj]}"])
    t = Trainer(derive_plan(cfg), Tracker(tmp_path, cfg.tracking, {}, "async"), tmp_path)
    try:
        t.build_groups()
        batch = t.rollouts()
        batch.tensors["scores"] = (torch.arange(len(batch)) % 2).float()
        t.update(t.advantages(t.logprobs(batch)))
        assert _rollout_vs_actor(t) > 1e-3, "before the sync the rollout still has the base weights"
        t.sync()
        t.pipeline.load_engines()  # queued behind the generation the sync started
        assert t.group("rollout").call_all(Worker.weights_version) == [1]
        assert _rollout_vs_actor(t) < 1e-5
    finally:
        t.shutdown()
        t.tracker.close()


@pytest.mark.slow
def test_frozen_rollout_worker_is_a_stall_and_recovers(tmp_path, ray_local):
    # The 3rd generate call (submitted after step 1's sync, taken by step 3) SIGSTOPs the rollout worker: the
    # pipeline's wait names it within cluster.stall_s, and the supervisor rebuilds and reruns from the start.
    out = tmp_path / "run"
    fault = f"generate_at:3:{tmp_path / 'fired'}"
    records = train_run("examples/quickstart.yaml", out, *SHORT, *SPLIT, "trainer.mode=async",
                        "trainer.max_staleness=1", "trainer.total_steps=4", "cluster.stall_s=4",
                        "trainer.restart_wait_s=30", "trainer.max_restarts=1",
                        f"cluster.env={{FLEETRL_FAULT_STOP: '{fault}'}}")
    assert (tmp_path / "fired").exists(), "the fault never fired"
    stall = [r for r in records if r.get("event") == "stall"]
    assert len(stall) == 1 and "pool 'gen' rank 0" in stall[0]["error"], records
    assert "in phase 'generate_at'" in stall[0]["error"] and "made no progress for" in stall[0]["error"]
    assert {r["step"] for r in records if "train/reward_mean" in r} == set(range(1, 5))


@pytest.mark.slow
def test_slow_generate_call_past_its_deadline_is_a_stall(tmp_path, ray_local):
    # Every heartbeat sleeps 1 s: a 4-token generation takes >= 4 s, past the 2 s deadline of generate_at, while
    # still beating (so it is the deadline, not the stall clock, that fires). No restarts: the error surfaces.
    from fleetrl.cluster.watchdog import StallError

    with pytest.raises(StallError, match=r"pool 'gen' rank 0 .* did not finish within the call deadline of 2s "
                                         r"\(cluster.call_timeout_s\) in phase 'generate_at'"):
        train_run("examples/quickstart.yaml", tmp_path / "run", *SHORT, *SPLIT, "trainer.mode=async",
                  "trainer.total_steps=2", "cluster.stall_s=30", "cluster.call_timeouts={generate_at: 2}",
                  "cluster.env={FLEETRL_FAULT_BEAT_DELAY_S: '1'}")


@pytest.mark.slow
def test_resume_regenerates_the_untrained_prompts(tmp_path, ray_local):
    # A checkpoint at step 2 keeps no in-flight generation: the resumed run draws the prompts of step 3 again
    # and generates them at version 2, the one step 3 trains: staleness 0 (a straight run had 1 there).
    out = tmp_path / "run"
    common = (*SHORT, *SPLIT, "trainer.mode=async", "trainer.max_staleness=1", "trainer.save_every=2")
    train_run("examples/quickstart.yaml", out, *common, "trainer.total_steps=2")
    records = train_run("examples/quickstart.yaml", out, *common, "trainer.total_steps=3", "trainer.resume=auto")
    step3 = [r for r in records if r.get("step") == 3 and "train/reward_mean" in r]
    assert len(step3) == 1 and step3[0]["train/async/staleness_max"] == 0
    assert any(r.get("event") == "resumed" for r in records)


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


@pytest.mark.slow
def test_packed_training_in_async_mode_matches_padded(tmp_path, ray_local):
    # Token-budget micro-batches with fused log-probs (small budgets for the tiny model) on the actor pool while
    # the rollout pool generates ahead, k=1 with TIS computed in the loss: the same per-step numbers as padded
    # micro-batches. Steps 1 and 2 train samples of version 0 in both runs, so their batches are identical.
    common = (*SHORT, *SPLIT, "trainer.total_steps=2", "trainer.mode=async", "trainer.max_staleness=1",
              "algorithm.rollout_correction.mode=tis")
    skip = ("train/actor/tokens_slots",)  # the packed forward computes other token slots (less padding)
    padded, packed = (
        [{k: v for k, v in r.items() if not k.startswith(skip)} for r in _numbers(train_run(
            "examples/quickstart.yaml", tmp_path / name, *common, *extra))]
        for name, extra in (("padded", ()), ("packed", ("algorithm.micro_batch_tokens=48",
                                                        "actor.fused_logprob_chunk=16"))))
    assert len(padded) == len(packed) == 2
    assert padded[1]["train/rollout_is/ratio_max"] > 1.0  # step 2 trains version 1 on version-0 samples
    for step, (a, b) in enumerate(zip(padded, packed), start=1):
        assert a.keys() == b.keys(), f"step {step}: {sorted(set(a) ^ set(b))}"
        for k in a:
            assert math.isclose(a[k], b[k], rel_tol=1e-4, abs_tol=1e-6), (step, k, a[k], b[k])
