"""Epoch mode (trainer.total_steps: null): the Plan sizes the run from the training set, and the LR schedule
spans the run's real optimiser steps (it used to be built for 1 step, so cosine fell to its floor at step 2)."""
import math

import pytest

from fleetrl.config import ConfigError, derive_plan, load_config
from tests.integration.helpers import train_run

EPOCHS = ("trainer.total_steps=null", "trainer.total_epochs=2", "data.train=synthetic:copy?n=16&split=train",
          "data.prompts_per_step=8")


def test_plan_derives_steps_from_the_training_set():
    plan = derive_plan(load_config("examples/quickstart.yaml", [*EPOCHS, "algorithm.mini_batch_prompts=4",
                                                               "algorithm.ppo_epochs=3"]), train_prompts=16)
    # 16 prompts / 8 per step = 2 steps per epoch, × 2 epochs = 4 steps; × 2 mini-batches × 3 epochs = 24 updates
    assert (plan.total_steps, plan.actor_optimizer_steps) == (4, 24)


def test_epoch_mode_needs_the_training_set_size():
    with pytest.raises(ConfigError, match="total_epochs needs the training set's size"):
        derive_plan(load_config("examples/quickstart.yaml", EPOCHS))
    with pytest.raises(ConfigError, match="set exactly one of trainer.total_steps and trainer.total_epochs"):
        derive_plan(load_config("examples/quickstart.yaml", ["trainer.total_epochs=2"]))


def test_cosine_schedule_spans_every_step_in_epoch_mode(tmp_path):
    records = train_run("examples/quickstart.yaml", tmp_path, *EPOCHS, "cluster.backend=local",
                        "actor.optim.schedule=cosine", "actor.optim.min_lr_ratio=0.1", "actor.optim.lr=0.001",
                        "trainer.val_before_train=false", "trainer.val_every=0")
    lrs = [r["train/actor/lr"] / 0.001 for r in records if "train/actor/lr" in r]
    # 4 optimiser steps; the factor used at step k is 0.1 + 0.9 * (1 + cos(pi * k / 4)) / 2:
    # k=0: 1.0; k=1: 0.1 + 0.45 * 1.70711 = 0.86820; k=2: 0.55; k=3: 0.1 + 0.45 * 0.29289 = 0.23180.
    # It reaches the 0.1 floor only after the last step (the old code gave [1.0, 0.1, 0.1, 0.1]).
    want = [0.1 + 0.45 * (1 + math.cos(math.pi * k / 4)) for k in range(4)]
    assert lrs == pytest.approx(want, rel=1e-6)
