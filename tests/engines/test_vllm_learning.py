"""The copy-task learning test (tests/integration/test_learning.py, GRPO) with rollout.engine=vllm: the real vLLM
generates in the Ray rollout worker, every step syncs the actor's weights into it (checked by the probe), and
held-out greedy success must climb from < 20% to > 80% as it does with the hf engine."""
from __future__ import annotations

import pytest

from tests.integration.helpers import train_run, val_curve
from tests.integration.test_learning import CASES

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_copy_task_learns_with_vllm(tmp_path, ray_local):
    config, overrides = CASES["grpo"]
    records = train_run(config, tmp_path / "grpo-vllm", *overrides, "rollout.engine=vllm")
    curve = val_curve(records)
    assert curve[0] < 0.2, f"initial held-out success {curve[0]} should start below 20%"
    assert curve[-1] > 0.8, f"held-out success curve {curve} did not pass 80% with rollout.engine=vllm"
