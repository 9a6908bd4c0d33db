"""Resume is exact: 6 steps straight == 3 + resume + 3 (bitwise weights, identical metrics for steps 4-6);
a DP=2 checkpoint resumes at DP=1; an FSDP2 one loads bitwise sharded and unsharded; a truncated checkpoint is
skipped with a warning."""
import logging
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from fleetrl.checkpoint.manager import find_resume
from fleetrl.trainer.metric_names import is_machine_metric
from tests.integration.helpers import train_run

pytestmark = pytest.mark.slow
BASE = ("model.path=tiny:", "data.prompts_per_step=8", "rollout.n=4", "algorithm.mini_batch_prompts=4",
        "algorithm.micro_batch_size=8", "algorithm.ppo_epochs=2", "trainer.val_every=3", "data.val_max_prompts=16",
        "trainer.save_every=3", "trainer.keep_last=0")


def _weights(ckpt, role):
    reader = dcp.FileSystemReader(str(ckpt / role))
    meta = reader.read_metadata()
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.state_dict_metadata.items()
             if k.startswith("model.") and hasattr(v, "size")}
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def _steps(records, lo, hi):
    return [{k: v for k, v in r.items() if not is_machine_metric(k)}
            for r in records if "event" not in r and lo <= r["step"] <= hi and any(k.startswith("train/") for k in r)]


DP2 = ("cluster.pools.main.workers_per_node=2", "cluster.pools.main.cpus_per_worker=0.5")


# Two runs that several tests start from, trained once for the module (a train_run is ~10 s of CPU on the 2-core
# VM); a test that writes into a run (resumes it, truncates a checkpoint) works on its own copy.
@pytest.fixture(scope="module")
def straight_6(tmp_path_factory, ray_local):
    """6 steps straight (checkpoints at 3 and 6) and its records."""
    out = tmp_path_factory.mktemp("straight") / "a"
    return out, train_run("examples/ppo_tiny.yaml", out, *BASE, "trainer.total_steps=6")


@pytest.fixture(scope="module")
def dp2_3(tmp_path_factory, ray_local):
    """3 steps at DP=2 (checkpoint at 3)."""
    out = tmp_path_factory.mktemp("dp2") / "r"
    train_run("examples/ppo_tiny.yaml", out, *BASE, *DP2, "trainer.total_steps=3")
    return out


def test_exact_resume(tmp_path, ray_local, straight_6):
    run_a, straight = straight_6
    train_run("examples/ppo_tiny.yaml", tmp_path / "b", *BASE, "trainer.total_steps=3")
    resumed = train_run("examples/ppo_tiny.yaml", tmp_path / "b", *BASE, "trainer.total_steps=6", "trainer.resume=auto")
    assert any(r.get("event") == "resumed" for r in resumed)
    assert _steps(resumed, 4, 6) == _steps(straight, 4, 6) and len(_steps(straight, 4, 6)) == 3
    for role in ("actor", "critic"):
        a = _weights(run_a / "checkpoints" / "step_6", role)
        b = _weights(tmp_path / "b" / "checkpoints" / "step_6", role)
        assert a.keys() == b.keys() and len(a) > 0
        for k in a:
            assert torch.equal(a[k], b[k]), f"{role} {k} differs after resume"


def test_dp2_checkpoint_resumes_at_dp1(tmp_path, ray_local, dp2_3):
    shutil.copytree(dp2_3, tmp_path / "r")
    saved = _weights(tmp_path / "r" / "checkpoints" / "step_3", "actor")
    records = train_run("examples/ppo_tiny.yaml", tmp_path / "r", *BASE, "trainer.total_steps=6",
                        "trainer.resume=auto")
    assert max(r["step"] for r in records) == 6
    # the DP=1 run resumed at the DP=2 run's step 3 (test_loaded_weights_equal_saved checks the weights it loads)
    resumed_from = [r for r in records if r.get("event") == "resumed"]
    assert resumed_from and resumed_from[0]["step"] == 3
    after = _weights(tmp_path / "r" / "checkpoints" / "step_6", "actor")
    assert any(not torch.equal(saved[k], after[k]) for k in saved), "training must continue after resume"


def _loaded(run, *overrides):
    """Every actor rank's weights after a trainer with `overrides` resumes `run`."""
    from fleetrl.config import derive_plan, load_config
    from fleetrl.tracking.tracker import Tracker
    from fleetrl.trainer.trainer import Trainer
    from fleetrl.workers.worker import Worker

    cfg = load_config("examples/ppo_tiny.yaml", [*BASE, *overrides, "trainer.resume=auto", "tracking.console=false"])
    trainer = Trainer(derive_plan(cfg), Tracker(run, cfg.tracking, {}, "x"), run)
    try:
        trainer.build_groups()
        trainer.maybe_resume()
        return trainer.group("actor").call_all(Worker.model_state, "actor")
    finally:
        trainer.shutdown()


def test_loaded_weights_equal_saved(tmp_path, ray_local, dp2_3):
    shutil.copytree(dp2_3, tmp_path / "s")
    saved = _weights(tmp_path / "s" / "checkpoints" / "step_3", "actor")
    live = _loaded(tmp_path / "s")[0]
    for k, v in saved.items():
        assert torch.equal(live[k.removeprefix("model.")], v)


def test_fsdp2_checkpoint_loads_sharded_and_unsharded(tmp_path, ray_local):
    # Each FSDP2 rank writes its own shards (collectively); loading re-shards them by name, at any world size.
    # Weight decay moves every weight each step (a random init rarely earns a reward in 3 steps, so the policy
    # gradient is often 0): the checkpoint must hold the updated shards, not the initial model.
    sharded = ("actor.sharding=fsdp2", "critic.sharding=fsdp2", "actor.optim.weight_decay=0.1")
    train_run("examples/ppo_tiny.yaml", tmp_path / "f", *BASE, *DP2, *sharded, "trainer.total_steps=3")
    saved = _weights(tmp_path / "f" / "checkpoints" / "step_3", "actor")
    from fleetrl.models.hf import load_causal_lm

    initial = load_causal_lm("tiny:").state_dict()
    assert all(not torch.equal(saved[k], initial[k.removeprefix("model.")]) for k in saved)
    for overrides in ((*DP2, *sharded), ()):
        for live in _loaded(tmp_path / "f", *overrides):
            for k, v in saved.items():
                assert torch.equal(live[k.removeprefix("model.")], v), f"{overrides}: {k}"


def test_truncated_checkpoint_is_skipped(tmp_path, straight_6, caplog):
    shutil.copytree(straight_6[0], tmp_path / "t")
    victim = next((tmp_path / "t" / "checkpoints" / "step_6" / "actor").glob("*.distcp"))
    victim.write_bytes(victim.read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger="fleetrl.checkpoint"):
        found = find_resume(tmp_path / "t", "auto")
    assert found is not None and found.name == "step_3"
    assert "step_6" in caplog.text and "truncated" in caplog.text
