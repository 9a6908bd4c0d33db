"""Through the real trainer (local backend): packed token-budget micro-batches with fused log-probs train as the
padded sample-count micro-batches do: the same losses, entropy, KL and gradient norms per step."""
import math

import pytest

from fleetrl.trainer.metric_names import is_machine_metric
from tests.integration.helpers import train_run

pytestmark = pytest.mark.slow
# Two mini-batches: the old-logprob pass (batched_logprobs) runs packed too, not just the update.
ARGS = ("trainer.total_steps=2", "trainer.val_every=0", "trainer.val_before_train=false", "cluster.backend=local",
        "algorithm.mini_batch_prompts=16", "algorithm.micro_batch_size=8")
PACKED = ("algorithm.micro_batch_tokens=96", "actor.fused_logprob_chunk=64")


def _train_metrics(records):
    # tokens_slots: the packed forward computes fewer token slots (less padding)
    return [{k: v for k, v in r.items() if k.startswith("train/") and not is_machine_metric(k)
             and "tokens_slots" not in k and isinstance(v, float)} for r in records if "train/time/step" in r]


def test_packed_fused_training_matches_padded(tmp_path):
    padded = _train_metrics(train_run("examples/quickstart.yaml", tmp_path / "padded", *ARGS))
    packed = _train_metrics(train_run("examples/quickstart.yaml", tmp_path / "packed", *ARGS, *PACKED))
    assert len(padded) == len(packed) == 2
    for step, (a, b) in enumerate(zip(padded, packed)):
        assert a.keys() == b.keys()
        assert "train/actor/pg_loss" in a and "train/actor/grad_norm" in a
        for k in a:
            assert math.isclose(a[k], b[k], rel_tol=1e-4, abs_tol=1e-6), (step, k, a[k], b[k])
