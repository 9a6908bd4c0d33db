"""rollout.env: its numbers checked with the config, its spec where the run is assembled (both before training),
and the per-step episode metrics."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fleetrl.batch import Batch
from fleetrl.config import derive_plan, load_config
from fleetrl.config.load import ConfigError
from fleetrl.envs.check import check_env_config
from fleetrl.rewards.scorer import RewardScorer
from fleetrl.trainer.metrics import episode_metrics
from fleetrl.trainer.run import plan_for

EXAMPLE = "examples/tools_lookup_tiny.yaml"


def test_the_example_plans_an_episode_wide_response():
    plan = derive_plan(load_config(EXAMPLE))
    env = plan.config.rollout.env
    assert env.name == "lookup" and dict(env.kwargs) == {"with_key": False, "valid_call_reward": 0.1}
    assert plan.action_mask == "loss_mask"
    # The engine must hold a prompt plus a whole episode: 32 + 8 tokens, not 32 + max_new_tokens (1).
    assert plan.rollout.max_seq_len == 32 + 8
    assert derive_plan(load_config("examples/quickstart.yaml")).action_mask == "response_mask"


@pytest.mark.parametrize(("override", "match"), [
    ("rollout.env.max_turns=0", r"rollout\.env\.max_turns must be >= 1, got 0"),
    ("rollout.env.max_tokens_per_turn=0", r"rollout\.env\.max_tokens_per_turn must be >= 1, got 0"),
    ("rollout.env.timeout_s=0", r"rollout\.env\.timeout_s must be > 0"),
    ("algorithm.overlong.buffer=1", r"set algorithm\.overlong\.buffer=0"),
])
def test_a_bad_env_number_fails_at_config_time_naming_the_field(override, match):
    with pytest.raises(ConfigError, match=match):
        derive_plan(load_config(EXAMPLE, [override]))


@pytest.mark.parametrize(("override", "match"), [
    ("rollout.env.name=lokup", r"rollout\.env\.name.*unknown environment 'lokup'.*'lookup'"),
    ("rollout.env.name=nowhere/env.py:Env", r"rollout\.env\.name.*nowhere/env\.py does not exist"),
    ("rollout.env.kwargs={colour: 1}", r"rollout\.env.*cannot construct it with \{'colour': 1\}.*with_key"),
])
def test_a_bad_env_spec_fails_where_the_run_is_assembled_naming_the_field(override, match):
    # Config knows no environments: its plan passes, and the run's assembly (plan_for, which `fleetrl train`
    # runs before Ray or a run directory) builds one instance and fails.
    cfg = load_config(EXAMPLE, [override])
    derive_plan(cfg)
    with pytest.raises(ConfigError, match=match):
        check_env_config(cfg.rollout.env)
    with pytest.raises(ConfigError, match=match):
        plan_for(cfg)


def test_an_unknown_env_key_is_named_by_the_loader():
    with pytest.raises(ConfigError, match=r"unknown config key 'rollout\.env\.max_turn'.*max_turns"):
        load_config(EXAMPLE, ["rollout.env.max_turn=3"])


def test_episode_metrics_are_means_per_episode():
    # Two episodes: (turns 2, 1 call, 0 errors, 0.5 s, 4 model + 5 env tokens) and
    # (turns 3, 2 calls, 1 error, 1.5 s, 6 model + 5 env tokens, one env error, one timeout); they waited 0.25 s
    # and 0.75 s on environment replies.
    b = Batch({"env_turns": torch.tensor([2.0, 3.0]), "env_tool_calls": torch.tensor([1.0, 2.0]),
               "env_tool_errors": torch.tensor([0.0, 1.0]), "env_tool_time_s": torch.tensor([0.5, 1.5]),
               "env_timeouts": torch.tensor([0.0, 1.0]), "env_env_errors": torch.tensor([0.0, 1.0]),
               "env_model_tokens": torch.tensor([4.0, 6.0]), "env_env_tokens": torch.tensor([5.0, 5.0]),
               "env_env_wait_s": torch.tensor([0.25, 0.75])},
              {"finish_reason": ["done", "timeout"]})
    m = episode_metrics(b)
    assert m["train/env/turns"] == 2.5 and m["train/env/tool_calls"] == 1.5 and m["train/env/tool_errors"] == 0.5
    assert m["train/env/tool_time_s"] == 1.0 and m["train/env/timeouts"] == 0.5 and m["train/env/env_errors"] == 0.5
    assert m["train/env/env_token_share"] == 10 / 20  # (5 + 5) env of (4 + 5 + 6 + 5) trajectory tokens
    assert m["train/env/finish_done"] == 0.5 and m["train/env/finish_timeout"] == 0.5
    assert m["train/env/env_wait_s"] == 0.5  # (0.25 + 0.75) / 2


def test_with_an_env_the_score_is_the_episode_reward_and_sources_need_no_scorer():
    from fleetrl.models.hf import load_tokenizer

    cfg = load_config(EXAMPLE)
    scorer = RewardScorer(cfg, load_tokenizer("tiny:"))
    try:
        scorer.check_sources({"synthetic/lookup"})  # no rewards.sources entry: fine, the env scores
        batch = Batch({"env_reward": torch.tensor([1.1, 0.0, 0.1])}, {"data_source": np.array(["x"] * 3)})
        scores, stats = scorer.score(batch)
        assert scores.tolist() == pytest.approx([1.1, 0.0, 0.1]) and stats == {}
    finally:
        scorer.close()
