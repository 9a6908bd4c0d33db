"""Training against a remote reward server (`fleetrl serve-reward`): scores come over HTTP; a server that is
down at start makes training refuse to start, with a message that says how to start one."""
import socket

import pytest

from fleetrl.rewards.remote import RemoteRewardError
from tests.integration.helpers import train_run
from tests.rewards.serving import serving

FAST = ("cluster.backend=local", "trainer.total_steps=2", "data.prompts_per_step=8", "data.val=null",
        "trainer.val_every=0", "model.path=tiny:")


def test_training_scores_through_a_reward_server(tmp_path):
    with serving(fn="prefix_match") as server:
        metrics = train_run("examples/quickstart.yaml", tmp_path / "run", *FAST,
                            f"rewards.remote_urls=['{server.url}']")
    steps = [m for m in metrics if "train/reward_mean" in m]
    assert len(steps) == 2 and all(m["train/reward_errors"] == 0 for m in steps)


def test_training_refuses_to_start_when_the_server_is_down(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once the socket closes
    with pytest.raises(RemoteRewardError, match=rf"127.0.0.1:{port}.*not reachable.*serve-reward"):
        train_run("examples/quickstart.yaml", tmp_path / "run", *FAST, f"rewards.remote_urls=['http://127.0.0.1:{port}']",
                  "rewards.remote_timeout_s=2")
