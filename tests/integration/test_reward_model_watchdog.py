"""The watchdog and recovery cover the reward_model role: an RM worker frozen (SIGSTOP) inside its scoring call is
named as a stall of pool 'rm' in phase 'score_rm', and the run recovers from its checkpoint and finishes."""
import time

import pytest

from tests.integration.helpers import train_run

pytestmark = pytest.mark.slow
BASE = ("model.path=tiny:", "data.prompts_per_step=8", "trainer.val_every=0", "trainer.val_before_train=false",
        "algorithm.micro_batch_size=16", "trainer.save_every=2", "cluster.stall_s=4", "trainer.restart_wait_s=30",
        "rewards.model={path: 'tiny:'}", "cluster.pools={main: {cpus_per_worker: 0.25}, rm: {cpus_per_worker: 0.25}}",
        "cluster.roles={actor: main, rollout: main, reward_model: rm}")


def test_frozen_rm_worker_is_named_and_recovered(tmp_path, ray_local):
    out = tmp_path / "run"
    fault = f"score_rm:3:{tmp_path / 'fired'}"
    t0 = time.monotonic()
    records = train_run("examples/quickstart.yaml", out, *BASE, "trainer.total_steps=5", "trainer.max_restarts=1",
                        f"cluster.env={{FLEETRL_FAULT_STOP: '{fault}'}}")
    assert (tmp_path / "fired").exists(), "the fault never fired"
    stall = [r for r in records if r.get("event") == "stall"]
    assert len(stall) == 1, records
    assert "pool 'rm' rank 0" in stall[0]["error"] and "in phase 'score_rm'" in stall[0]["error"], stall[0]["error"]
    assert {r["step"] for r in records if "train/rm_score_mean" in r} == set(range(1, 6))
    assert any(r.get("event") == "resumed" for r in records)
    assert time.monotonic() - t0 < 150
