import math

import pytest
import torch
from torch.testing import assert_close

from fleetrl.algo.kl import AdaptiveKLController, FixedKLController, kl_estimate, make_kl_controller

LOGP = torch.tensor([[0.0, -1.0]])
REF = torch.tensor([[-1.0, 0.0]])


def test_k1():
    # logp - ref = [0 - (-1), -1 - 0] = [1, -1]
    assert_close(kl_estimate(LOGP, REF, "k1"), torch.tensor([[1.0, -1.0]]))


def test_k2():
    # 0.5 * [1, -1]^2 = [0.5, 0.5]
    assert_close(kl_estimate(LOGP, REF, "k2"), torch.tensor([[0.5, 0.5]]))


def test_k3():
    # log r = ref - logp = [-1, 1]; exp(log r) - log r - 1 = [e^-1 + 1 - 1, e - 1 - 1] = [0.367879, 0.718282]
    assert_close(kl_estimate(LOGP, REF, "k3"), torch.tensor([[0.367879, 0.718282]]), atol=1e-5, rtol=1e-5)


def test_k3_zero_when_equal_and_clamped_when_far():
    assert_close(kl_estimate(REF, REF, "k3"), torch.zeros(1, 2))
    # log r = -100 clamps to -20: exp(-20) + 20 - 1 = 19.000000002; log r = +100 -> e^20 - 21, finite
    out = kl_estimate(torch.tensor([0.0, 0.0]), torch.tensor([-100.0, 100.0]), "k3")
    assert_close(out, torch.tensor([19.0, math.exp(20) - 21]))


def test_fixed_controller_never_moves():
    c = FixedKLController(0.05)
    c.update(current_kl=100.0, n_steps=1000)
    assert c.coef == 0.05


@pytest.mark.parametrize(
    "kl, expected",
    [
        # err = 9/6 - 1 = 0.5, clipped to 0.2 -> 0.1 * (1 + 0.2 * 100 / 10000) = 0.1002
        (9.0, 0.1002),
        # err = 3/6 - 1 = -0.5, clipped to -0.2 -> 0.1 * (1 - 0.002) = 0.0998
        (3.0, 0.0998),
        # err = 6.6/6 - 1 = 0.1, inside the clip -> 0.1 * (1 + 0.1 * 100 / 10000) = 0.1 * 1.001 = 0.1001
        (6.6, 0.1001),
    ],
)
def test_adaptive_controller_one_update(kl, expected):
    c = AdaptiveKLController(init_coef=0.1, target=6.0, horizon=10000)
    c.update(current_kl=kl, n_steps=100)
    assert c.coef == pytest.approx(expected, rel=1e-9)


def test_controller_state_roundtrip():
    a = AdaptiveKLController(0.1, 6.0, 10000)
    a.update(9.0, 100)
    b = AdaptiveKLController(0.5, 6.0, 10000)
    b.load_state_dict(a.state_dict())
    assert b.coef == a.coef
    f = FixedKLController(0.0)
    f.load_state_dict({"coef": 0.2})
    assert f.state_dict() == {"coef": 0.2}


def test_make_kl_controller():
    assert isinstance(make_kl_controller("fixed", 0.1), FixedKLController)
    c = make_kl_controller("adaptive", 0.1, target=6.0, horizon=10000)
    assert isinstance(c, AdaptiveKLController) and c.coef == 0.1
    with pytest.raises(ValueError, match="needs target and horizon"):
        make_kl_controller("adaptive", 0.1)
    with pytest.raises(ValueError, match="did you mean 'fixed'"):
        make_kl_controller("fixd", 0.1)
    with pytest.raises(ValueError, match="target > 0"):
        AdaptiveKLController(0.1, target=0.0, horizon=10)
