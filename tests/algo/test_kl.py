
import pytest
import torch
from torch.testing import assert_close

from fleetrl.algo.kl import (
    K3_MAX,
    AdaptiveKLController,
    FixedKLController,
    kl_estimate,
    make_kl_controller,
)

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
    # log r = -100 clamps to -20: exp(-20) + 20 - 1 = 19.000000002 > 10 -> 10;
    # log r = +100 clamps to +20: e^20 - 21 = 4.85e8 > 10 -> 10
    out = kl_estimate(torch.tensor([0.0, 0.0]), torch.tensor([-100.0, 100.0]), "k3")
    assert_close(out, torch.tensor([K3_MAX, K3_MAX]))
    assert K3_MAX == 10.0


def test_k3_value_and_gradient_bounded_at_large_negative_log_ratio():
    # log(pi / pi_ref) = logp - ref = [-5, -20, 0.5]  ->  log r = ref - logp = [5, 20, -0.5]
    # unclamped: e^5 - 5 - 1 = 142.41 (d/dlogp = 1 - e^5 = -147.41); e^20 - 21 = 4.85e8 (d/dlogp = 1 - e^20)
    # clamped to 10 with zero gradient; the ordinary token -0.5: e^-0.5 + 0.5 - 1 = 0.106531,
    # d/dlogp = 1 - e^-0.5 = 0.393469 (unchanged by the clamp)
    logp = torch.tensor([[-5.0, -20.0, 0.5]], requires_grad=True)
    out = kl_estimate(logp, torch.zeros(1, 3), "k3")
    out.sum().backward()
    assert_close(out.detach(), torch.tensor([[10.0, 10.0, 0.106531]]), atol=1e-5, rtol=1e-5)
    assert_close(logp.grad, torch.tensor([[0.0, 0.0, 0.393469]]), atol=1e-5, rtol=1e-5)


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
