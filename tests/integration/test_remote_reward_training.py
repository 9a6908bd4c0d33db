"""Training against a remote reward server (`fleetrl serve-reward`): scores come over HTTP; a server that is
down at start makes training refuse to start, with a message that says how to start one."""
from pathlib import Path

import pytest

from fleetrl.rewards.remote import RemoteRewardError
from tests.integration.helpers import train_run
from tests.rewards.serving import refusing_url, serving

ASSETS = Path(__file__).parent / "assets"
FAST = ("cluster.backend=local", "trainer.total_steps=2", "data.prompts_per_step=8", "data.val=null",
        "trainer.val_every=0", "model.path=tiny:")


def test_training_scores_through_a_reward_server(tmp_path):
    # The served scorer returns 0.75 for every sample, which no local scorer gives: a run whose reward mean is 0.75
    # scored over HTTP, not through the local builtin that quickstart's data source would otherwise use.
    with serving(fn=f"{ASSETS}/bad_rewards.py:served_constant") as server:
        metrics = train_run("examples/quickstart.yaml", tmp_path / "run", *FAST,
                            f"rewards.remote_urls=['{server.url}']")
    steps = [m for m in metrics if "train/reward_mean" in m]
    assert len(steps) == 2
    assert all(m["train/reward_mean"] == 0.75 and m["train/reward_errors"] == 0 for m in steps)


def test_training_refuses_to_start_when_the_server_is_down(tmp_path):
    with refusing_url() as dead, pytest.raises(RemoteRewardError, match=rf"{dead}.*not reachable.*serve-reward"):
        train_run("examples/quickstart.yaml", tmp_path / "run", *FAST, f"rewards.remote_urls=['{dead}']",
                  "rewards.remote_timeout_s=2")
