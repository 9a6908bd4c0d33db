"""trainer.mode=async through real Ray workers, operations: a frozen rollout worker is a stall the supervisor
recovers from; a slow generate call past its deadline is named; a resume regenerates the untrained prompts; the
object-store weight path delivers LoRA weights; packed micro-batches give the padded numbers."""
from __future__ import annotations

import math

import pytest
import torch

from fleetrl.config import derive_plan, load_config
from fleetrl.tracking.tracker import Tracker
from fleetrl.trainer.trainer import SEQ_KEYS, Trainer
from fleetrl.workers.worker import Worker
from tests.integration.helpers import train_run
from tests.integration.test_async import SHORT, SPLIT, _numbers


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
