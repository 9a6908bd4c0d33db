"""`fleetrl serve-reward --model`: a reward model behind the same HTTP API, reached by the trainer's client."""

import pytest
import requests
import torch

from fleetrl.config.reward_model import RewardModelConfig
from fleetrl.rewards.model import build_scorer
from fleetrl.rewards.remote import RemoteRewardClient
from fleetrl.rewards.server import RewardServer, ServeOptions
from tests.rewards.serving import serving

RM = RewardModelConfig(path="tiny:seed=3", max_length=32)
PROMPTS = [[{"role": "user", "content": "copy a b 7 ="}], "copy c d 2 ="]
RESPONSES = ["7", "5 a"]




def test_served_model_scores_like_the_local_one():
    local = build_scorer(RM, torch.device("cpu")).score(PROMPTS, RESPONSES).scores_B.tolist()
    with serving(model=RM) as server:
        client = RemoteRewardClient([server.url])
        client.check_health()
        assert requests.get(f"{server.url}/health", timeout=5).json()["scorer"] == "model:tiny:seed=3"
        result = client.score_result(RESPONSES, [None, None], ["a", "b"], [{}, {}], prompts=PROMPTS)
    assert result.scores == pytest.approx(local, abs=1e-6)


def test_model_server_needs_prompts():
    with serving(model=RM) as server:
        reply = requests.post(f"{server.url}/score", json={"responses": RESPONSES}, timeout=5)
    assert reply.status_code == 400 and "send 'prompts'" in reply.json()["error"]


@pytest.mark.parametrize("kw", [{}, {"fn": "prefix_match", "model": RM}])
def test_exactly_one_of_fn_and_model(kw):
    with pytest.raises(ValueError, match="exactly one of --fn .* and --model"):
        RewardServer(ServeOptions(port=0, **kw))
