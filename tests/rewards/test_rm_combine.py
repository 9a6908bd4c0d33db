"""rewards.combine arithmetic and the running normaliser of RM scores (hand-computed)."""
import math

import pytest
import torch

from fleetrl.config import load_config
from fleetrl.config.reward_model import combine_weights
from fleetrl.rewards.combine import RunningNorm, combine_scores


def _weights(*overrides):
    rewards = load_config(None, ["rewards.model={path: 'tiny:'}", *overrides]).rewards
    return lambda s: combine_weights(rewards, s)


def test_per_source_weights_and_default():
    w = _weights("rewards.combine={a: {rule: 1, model: 0}, default: {rule: 0, model: 1}}")
    got = combine_scores(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0.5, 2.0, -1.0]), ["a", "b", "c"], w)
    # a: 1·1 + 0·0.5 = 1; b (default): 0·0 + 1·2 = 2; c (default): 0·1 + 1·(-1) = -1
    assert got.tolist() == [1.0, 2.0, -1.0]


def test_unlisted_source_without_default_adds_rule_and_model():
    w = _weights("rewards.combine={a: {rule: 2, model: 0.5}}")
    got = combine_scores(torch.tensor([1.0, 1.0]), torch.tensor([4.0, -1.0]), ["a", "z"], w)
    # a: 2·1 + 0.5·4 = 4; z: 1·1 + 1·(-1) = 0
    assert got.tolist() == [4.0, 0.0]


def test_running_norm_matches_hand_computed_welford():
    norm = RunningNorm()
    norm.update(torch.tensor([1.0, 3.0]))  # mean 2, population var ((1-2)² + (3-2)²)/2 = 1
    assert (norm.count, norm.mean, norm.std) == (2, 2.0, 1.0)
    out = norm.normalize(torch.tensor([5.0]))
    # now {1, 3, 5}: mean 3, var (4 + 0 + 4)/3 = 8/3; (5 - 3)/sqrt(8/3) = 1.2247449
    assert norm.mean == pytest.approx(3.0) and norm.std == pytest.approx(math.sqrt(8 / 3))
    assert out.item() == pytest.approx(2 / math.sqrt(8 / 3), rel=1e-6)


def test_running_norm_state_round_trip():
    a = RunningNorm()
    a.update(torch.tensor([0.0, 2.0, 4.0]))
    b = RunningNorm()
    b.load_state_dict(a.state_dict())
    x = torch.tensor([6.0])
    # both now see {0, 2, 4, 6}: mean 3, var (9+1+1+9)/4 = 5
    assert a.normalize(x).item() == b.normalize(x).item() == pytest.approx(3 / math.sqrt(5), rel=1e-6)


def test_empty_running_norm_is_identity_scale():
    assert RunningNorm().std == 1.0
