"""Through the real trainer (local backend): actor.forward=native (our own Llama decoder, models/decoder.py) trains
as HF's modelling code does: the same losses, entropy, KL and gradient norms per step, padded and packed."""
import math

import pytest

from fleetrl.models.native import NativeForward
from tests.integration.helpers import train_run

pytestmark = pytest.mark.slow
# Two mini-batches: the old-logprob pass (batched_logprobs) runs through the chosen forward too, not just the
# update; the second step trains on weights the first step changed.
ARGS = ("trainer.total_steps=2", "trainer.val_every=0", "trainer.val_before_train=false", "cluster.backend=local",
        "algorithm.mini_batch_prompts=16", "algorithm.micro_batch_size=8")
PACKED = ("algorithm.micro_batch_tokens=96", "actor.fused_logprob_chunk=64")


def _train_metrics(records):
    skip = ("/time/", "tokens_per_s", "tokens_slots", "mem", "rss")
    return [{k: v for k, v in r.items() if k.startswith("train/") and not any(s in k for s in skip)
             and isinstance(v, float)} for r in records if "train/time/step" in r]


@pytest.mark.parametrize("layout", [(), PACKED], ids=["padded", "packed"])
def test_native_forward_training_matches_hf(tmp_path, monkeypatch, layout):
    calls = []
    call = NativeForward.__call__
    monkeypatch.setattr(NativeForward, "__call__", lambda self, *a, **k: calls.append(1) or call(self, *a, **k))
    hf = _train_metrics(train_run("examples/quickstart.yaml", tmp_path / "hf", *ARGS, *layout))
    native = _train_metrics(train_run("examples/quickstart.yaml", tmp_path / "native", *ARGS, *layout,
                                      "actor.forward=native"))
    assert len(hf) == len(native) == 2
    assert calls, "the local backend runs the actor in-process: the native forward must have been called"
    for step, (a, b) in enumerate(zip(hf, native)):
        assert a.keys() == b.keys()
        assert "train/actor/pg_loss" in a and "train/actor/grad_norm" in a
        for k in a:
            assert math.isclose(a[k], b[k], rel_tol=1e-4, abs_tol=1e-6), (step, k, a[k], b[k])
