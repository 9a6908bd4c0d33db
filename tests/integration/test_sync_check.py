"""The policy check after every weight sync (engines/sync_check.py): a sync that silently skips parameters (LoRA
adapters, a tied head, a bucket of sharded tensors; FLEETRL_FAULT_SYNC_SKIP, workers/sync_faults.py) is caught at
the first sync after the first update, i.e. within one step, on the hf and fast engines, colocated (one pool, the
in-process backend) and across pools (cluster.backend=ray, a separate rollout pool).

Each run's entropy bonus moves every weight at step 1 (GRPO alone gives a random tiny model's groups equal rewards,
so zero advantages and no update), and lr 0.05 makes one step's change show well above the 0.05 threshold.
With `SYNC_CHECK_TEST_THRESHOLD=inf` (the check never fires) every skip test here fails: the run trains on.
"""
import os

import pytest

from fleetrl.engines.sync_check import SyncCheckError
from tests.integration.helpers import read_metrics, train_run

pytestmark = pytest.mark.slow

THRESHOLD = os.environ.get("SYNC_CHECK_TEST_THRESHOLD", "0.05")
BASE = ("model.path=tiny:", "data.prompts_per_step=4", "rollout.n=4", "trainer.total_steps=2", "trainer.val_every=0",
        "trainer.val_before_train=false", "algorithm.entropy_coef=0.01", "actor.optim.lr=0.05",
        f"rollout.sync_check.threshold={THRESHOLD}", "trainer.save_last=false")
SPLIT = ("cluster.pools={train: {cpus_per_worker: 0.5}, gen: {cpus_per_worker: 0.5}}",
         "cluster.roles={actor: train, rollout: gen}", "cluster.init_timeout_s=90")
LORA = "actor.lora={rank: 4, targets: [q_proj, v_proj]}"
# skipped parameter -> (overrides, colocated pattern, across-pool pattern). Colocated, the engine reads the actor's
# own modules (adapters included, lora_B); across pools only the merged adapted projections travel (self_attn).
CASES = {
    "lora_adapters": ((LORA,), "lora_B", "self_attn"),
    "tied_head": (("model.path=tiny:tie=1",), "lm_head", "embed_tokens,lm_head"),
    "sharded_bucket": (("actor.sharding=fsdp2",), None, "layers.1."),  # a bucket's worth: all of layer 1
}


def _expect_caught(run, out, source: str = "probe") -> None:
    """probe: caught right after the first sync that follows an update (version 1, after step 1); step: on the
    samples that sync's weights generated, step 2's."""
    with pytest.raises(SyncCheckError) as e:
        run()
    msg, step = str(e.value), 1 if source == "probe" else 2
    where = "after step 1" if source == "probe" else "checked on step 2's samples"
    assert "weights version 1" in msg and where in msg, msg
    assert e.value.version == 1 and e.value.gap > 0.05
    failed = [r for r in read_metrics(out) if r.get("event") == "sync_check_failed"]
    assert failed and failed[0]["version"] == 1 and failed[0]["step"] == step


@pytest.mark.parametrize("source", ["step", "probe"])
@pytest.mark.parametrize("engine", ["hf", "fast"])
@pytest.mark.parametrize("case", ["lora_adapters", "tied_head"])
def test_colocated_skip_is_caught_within_one_step(tmp_path, monkeypatch, engine, case, source):
    overrides, pattern, _ = CASES[case]
    monkeypatch.setenv("FLEETRL_FAULT_SYNC_SKIP", pattern)
    out = tmp_path / "run"
    _expect_caught(lambda: train_run("examples/quickstart.yaml", out, *BASE, "cluster.backend=local",
                                     f"rollout.engine={engine}", f"rollout.sync_check.source={source}",
                                     *overrides), out, source)


@pytest.mark.parametrize("source", ["step", "probe"])
@pytest.mark.parametrize("engine", ["hf", "fast"])
def test_colocated_clean_run_passes_with_small_gaps(tmp_path, engine, source):
    records = train_run("examples/quickstart.yaml", tmp_path / "run", *BASE, "cluster.backend=local",
                        f"rollout.engine={engine}", f"rollout.sync_check.source={source}", LORA)
    gaps = [r["train/sync_check/gap"] for r in records if "train/sync_check/gap" in r]
    assert len(gaps) == 2 and max(gaps) < 1e-4, gaps


@pytest.mark.parametrize("source", ["step", "probe"])
@pytest.mark.parametrize("engine", ["hf", "fast"])
@pytest.mark.parametrize("case", ["lora_adapters", "tied_head", "sharded_bucket"])
def test_across_pools_skip_is_caught_within_one_step(tmp_path, ray_local, engine, case, source):
    overrides, _, pattern = CASES[case]
    out = tmp_path / "run"
    _expect_caught(lambda: train_run("examples/quickstart.yaml", out, *BASE, *SPLIT, f"rollout.engine={engine}",
                                     f"rollout.sync_check.source={source}", *overrides,
                                     f"cluster.env={{FLEETRL_FAULT_SYNC_SKIP: '{pattern}'}}"), out, source)


def test_restart_mode_restarts_then_stops_when_restarts_run_out(tmp_path, ray_local):
    """on_mismatch=restart is a recovery like a lost worker's (the supervisor needs Ray: one colocated pool)."""
    out = tmp_path / "run"
    with pytest.raises(SyncCheckError) as e:
        train_run("examples/quickstart.yaml", out, *BASE, LORA, "cluster.env={FLEETRL_FAULT_SYNC_SKIP: lora_B}",
                  "rollout.sync_check.source=probe",
                  "trainer.save_every=1",
                  "rollout.sync_check.on_mismatch=restart", "trainer.max_restarts=1", "trainer.restart_wait_s=1")
    assert e.value.restart
    events = [r["event"] for r in read_metrics(out) if "event" in r]
    # the skip is in every sync: caught, restarted from scratch (no checkpoint before step 1), caught again
    assert events.count("sync_check_failed") == 2 and events.count("restart") == 1, events
