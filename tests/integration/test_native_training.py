"""Through the real trainer (local backend): actor.forward=native (our own Llama decoder, models/decoder.py) trains
as HF's modelling code does: the same losses, entropy, KL and gradient norms per step, padded and packed."""
import math

import pytest

from fleetrl.models.native import NativeForward
from tests.integration.helpers import train_run
from tests.integration.test_packed_training import ARGS, PACKED, _train_metrics

pytestmark = pytest.mark.slow
# The run arguments (two mini-batches: the old-logprob pass runs through the chosen forward too; the second step
# trains on weights the first changed) and the per-step metrics are test_packed_training.py's.


SHARED = ("actor.share_prompts=true",)  # native only: one copy of each prompt in the packed row (models/packing.py)


@pytest.mark.parametrize("layout, native_only", [((), ()), (PACKED, ()), (PACKED, SHARED)],
                         ids=["padded", "packed", "packed_shared_prompts"])
def test_native_forward_training_matches_hf(tmp_path, monkeypatch, layout, native_only):
    calls = []
    call = NativeForward.__call__
    monkeypatch.setattr(NativeForward, "__call__", lambda self, *a, **k: calls.append(1) or call(self, *a, **k))
    hf = _train_metrics(train_run("examples/quickstart.yaml", tmp_path / "hf", *ARGS, *layout))
    native = _train_metrics(train_run("examples/quickstart.yaml", tmp_path / "native", *ARGS, *layout,
                                      "actor.forward=native", *native_only))
    assert len(hf) == len(native) == 2
    assert calls, "the local backend runs the actor in-process: the native forward must have been called"
    for step, (a, b) in enumerate(zip(hf, native)):
        assert a.keys() == b.keys()
        if native_only:  # shared prompts compute fewer tokens for the same samples; everything else is equal
            assert b.pop("train/actor/tokens_real") < a.pop("train/actor/tokens_real")
            a.pop("train/actor/padding_waste", None), b.pop("train/actor/padding_waste", None)
        assert "train/actor/pg_loss" in a and "train/actor/grad_norm" in a
        for k in a:
            assert math.isclose(a[k], b[k], rel_tol=1e-4, abs_tol=1e-6), (step, k, a[k], b[k])
