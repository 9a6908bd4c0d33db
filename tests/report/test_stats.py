import math

import pytest

from fleetrl.report.stats import band, mean_ci, welch_diff


def test_t_interval_by_hand():
    # [1, 2, 3]: mean 2, s = 1, n = 3; t_{0.975, 2} = 4.302653 -> half width 4.302653 / sqrt(3) = 2.484138
    iv = mean_ci([1.0, 2.0, 3.0])
    assert iv.mean == 2.0 and iv.n == 3 and iv.dof == 2
    assert iv.half_width == pytest.approx(2.484138, abs=1e-6)
    assert (iv.lo, iv.hi) == pytest.approx((2 - 2.484138, 2 + 2.484138), abs=1e-6)


def test_one_seed_has_no_interval():
    iv = mean_ci([0.5])
    assert iv.mean == 0.5 and math.isnan(iv.lo) and iv.fmt() == "0.500 (n=1, no CI)"
    assert mean_ci([]).fmt() == "-"


def test_welch_by_hand():
    # a = [1, 2, 3]: mean 2, var 1;  b = [4, 6, 8]: mean 6, var 4
    # se^2 = 1/3 + 4/3 = 5/3; dof = (5/3)^2 / ((1/3)^2/2 + (4/3)^2/2) = (25/9) / (17/18) = 50/17 = 2.941176
    # t_{0.975, 2.941176} = 3.218759 -> half width 3.218759 * sqrt(5/3) = 4.155400
    iv = welch_diff([1.0, 2.0, 3.0], [4.0, 6.0, 8.0])
    assert iv.mean == -4.0
    assert iv.dof == pytest.approx(50 / 17)
    assert (iv.lo, iv.hi) == pytest.approx((-4 - 4.155400, -4 + 4.155400), abs=1e-5)


def test_welch_needs_two_seeds_per_side():
    with pytest.raises(ValueError, match="at least 2 seeds per group.*got 1 and 3"):
        welch_diff([1.0], [1.0, 2.0, 3.0])


def test_identical_replicates_give_an_exact_difference():
    iv = welch_diff([0.5, 0.5], [0.25, 0.25])
    assert (iv.mean, iv.lo, iv.hi) == (0.25, 0.25, 0.25)


def test_band_uses_the_steps_every_seed_logged():
    # seed A logged steps 1..3, seed B stopped after step 2: the band covers steps 1 and 2 only.
    steps, cis = band([([1, 2, 3], [1.0, 2.0, 3.0]), ([1, 2], [3.0, 4.0])])
    assert steps == [1, 2]
    assert [c.mean for c in cis] == [2.0, 3.0]
