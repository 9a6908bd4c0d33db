"""Separate rollout pool: after a weight sync the rollout generates with the new weights (its logprobs equal
the trainer's), a stale engine refuses to generate, and a stalled receiver is a timeout error, not a hang."""
import signal
import time

import psutil
import pytest
import ray
import torch

from fleetrl.cluster.watchdog import StallError
from fleetrl.cluster.weight_sync import broadcast_weights
from fleetrl.config import derive_plan, load_config
from fleetrl.tracking.tracker import Tracker
from fleetrl.trainer.trainer import Trainer
from fleetrl.workers.worker import Worker

pytestmark = pytest.mark.slow
SPLIT = ["cluster.pools={train: {cpus_per_worker: 0.5}, gen: {cpus_per_worker: 0.5}}",
         "cluster.roles={actor: train, rollout: gen}", "model.path=tiny:", "data.prompts_per_step=8",
         "actor.optim.lr=0.01", "tracking.console=false", "cluster.init_timeout_s=90", "algorithm.micro_batch_size=16"]


@pytest.fixture(scope="module")
def trainer(tmp_path_factory, ray_local):
    tmp_path = tmp_path_factory.mktemp("ws")
    cfg = load_config("examples/quickstart.yaml", SPLIT)
    t = Trainer(derive_plan(cfg), Tracker(tmp_path, cfg.tracking, {}, "ws"), tmp_path)
    t.build_groups()
    yield t
    t.shutdown()


def _rollout_vs_actor(t: Trainer) -> float:
    batch = t.generate(t.train_feed.next_batch(8))
    actor = t.group("actor").call_split(Worker.compute_logprobs, batch.pick("prompts", "prompt_mask", "responses",
                                                                           "response_mask"))
    mask = batch["response_mask"].float()
    return float(((batch["rollout_logprobs"] - actor["old_logprobs"]).abs() * mask).max())


def test_sync_delivers_new_weights(trainer):
    assert _rollout_vs_actor(trainer) < 1e-5  # same initial weights
    batch = trainer.score(trainer.generate(trainer.train_feed.next_batch(8)))
    batch.tensors["scores"] = (torch.arange(len(batch)) % 2).float()
    trainer.update(trainer.advantages(trainer.logprobs(batch)))
    assert _rollout_vs_actor(trainer) > 1e-3, "before the sync the rollout still has the old weights"
    trainer.sync()
    assert trainer.group("rollout").call_all(Worker.weights_version) == [1]
    assert _rollout_vs_actor(trainer) < 1e-5


def test_stale_engine_refuses(trainer):
    held = trainer.progress.weights_version
    trainer.progress.weights_version = held + 5  # the controller believes a newer version was published
    try:
        with pytest.raises(ray.exceptions.RayTaskError, match=rf"weights version {held} but the step needs {held + 5}"):
            trainer.generate(trainer.train_feed.next_batch(8))
    finally:
        trainer.progress.weights_version = held


def test_stalled_receiver_times_out(trainer):
    info = trainer.group("rollout").node_infos()[0]
    proc = psutil.Process(info["pid"])
    proc.send_signal(signal.SIGSTOP)
    t0 = time.time()
    try:
        # the watchdog names the frozen receiver within the call's deadline (here 2 × 5 s)
        with pytest.raises(StallError, match=r"pool '.*' rank 0 .*in phase 'weight_sync'"):
            broadcast_weights(trainer.group("actor"), trainer.group("rollout"), 1, timeout_s=5)
    finally:
        proc.send_signal(signal.SIGCONT)
    assert time.time() - t0 < 30
