"""The same seed gives identical metrics in two runs on CPU (through real Ray workers)."""
import pytest

from fleetrl.trainer.metric_names import is_machine_metric
from tests.integration.helpers import train_run

pytestmark = pytest.mark.slow
ARGS = ("trainer.total_steps=4", "trainer.val_every=2", "data.prompts_per_step=8", "algorithm.mini_batch_prompts=4",
        "algorithm.micro_batch_size=8")


def _strip_timing(records):
    return [{k: v for k, v in r.items() if not is_machine_metric(k)} for r in records]


def test_same_seed_same_metrics(tmp_path, ray_local):
    a = _strip_timing(train_run("examples/ppo_tiny.yaml", tmp_path / "a", *ARGS))
    b = _strip_timing(train_run("examples/ppo_tiny.yaml", tmp_path / "b", *ARGS))
    assert len(a) >= 4 and a == b
    c = _strip_timing(train_run("examples/ppo_tiny.yaml", tmp_path / "c", *ARGS, "trainer.seed=1"))
    assert c != a, "a different seed must change the run"
