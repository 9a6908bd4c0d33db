"""Each estimator must LEARN the synthetic copy task on CPU: held-out greedy success from < 20% to > 80%
within a fixed step budget, through the real Ray workers."""
import pytest

from tests.integration.helpers import train_run, val_curve

pytestmark = pytest.mark.slow

COMMON = ("trainer.total_steps=100", "trainer.val_every=25")

CASES = {
    "grpo": ("examples/quickstart.yaml", COMMON),
    "rloo": ("examples/quickstart.yaml", (*COMMON, "algorithm.advantage=rloo")),
    "reinforce_plus_plus": ("examples/quickstart.yaml", (*COMMON, "algorithm.advantage=reinforce_plus_plus")),
    "ppo_gae_critic": ("examples/ppo_tiny.yaml", ()),
}


@pytest.mark.parametrize("name", list(CASES))
def test_estimator_learns(name, tmp_path, ray_local):
    config, overrides = CASES[name]
    curve = val_curve(train_run(config, tmp_path / name, *overrides))
    assert curve[0] < 0.2, f"{name}: initial held-out success {curve[0]} should start below 20%"
    assert curve[-1] > 0.8, f"{name}: held-out success curve {curve} did not pass 80%"
