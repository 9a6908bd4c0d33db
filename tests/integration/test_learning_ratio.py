"""The learning check of test_learning.py for the cases whose update uses the PPO ratio off-policy: PPO with a
critic and GAE, and GSPO with two mini-batches per step (held-out success from < 20% to > 80%)."""
import pytest

from tests.integration.test_learning import RATIO_CASES, check_learns

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", RATIO_CASES)
def test_estimator_learns(name, tmp_path, ray_local):
    check_learns(name, tmp_path)
