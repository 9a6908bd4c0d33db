"""A whole actor update with the rollout correction computed in the loss (no recompute pass) gives the loss,
gradients and rollout_is statistics of the old path (recompute pass, weights on the controller), on the same batch.
Local backend, tiny model, 4 prompts × 2 samples; padded and packed micro-batches."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fleetrl.batch import Batch
from fleetrl.config import derive_plan, load_config, to_dict
from fleetrl.tracking.tracker import Tracker
from fleetrl.trainer.trainer import Trainer

COMMON = ["cluster.backend=local", "data.prompts_per_step=4", "rollout.n=2", "algorithm.micro_batch_size=4",
          "trainer.total_steps=2", "tracking.progress=false", "tracking.console=false", "rollout.max_new_tokens=6",
          "algorithm.rollout_correction.cap=1.2"]
LAYOUTS = {"padded": [], "packed": ["algorithm.micro_batch_tokens=24", "actor.fused_logprob_chunk=8"]}
STATS = ("ratio_mean", "ratio_max", "ratio_min", "weight_mean", "clipped_frac", "masked_frac")


def _trainer(tmp_path: Path, *overrides: str) -> Trainer:
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = load_config("examples/quickstart.yaml", [*COMMON, *overrides, f"trainer.output_dir={tmp_path}"])
    trainer = Trainer(derive_plan(cfg), Tracker(tmp_path, cfg.tracking, to_dict(cfg), cfg.trainer.name), tmp_path)
    trainer.build_groups()
    return trainer


def _update(t: Trainer, batch: Batch) -> tuple[dict[str, float], list[torch.Tensor], Batch]:
    """Logprobs, advantages and the actor update of `batch`; returns the metrics, the gradients the optimiser
    stepped with, and the batch the update saw."""
    engine = t.group("actor").workers[0].actor.engine
    grads: list[torch.Tensor] = []
    real_step = engine.optimizer.step

    def recording_step(*args, **kwargs):
        grads.extend(p.grad.detach().clone() for p in engine.model.parameters() if p.grad is not None)
        return real_step(*args, **kwargs)

    engine.optimizer.step = recording_step
    recording_step._wrapped_by_lr_sched = True  # what the LR scheduler checks before warning of an override
    batch = t.advantages(t.logprobs(batch))
    return t.update(batch), grads, batch


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_in_loss_correction_equals_the_recompute_path(tmp_path: Path, layout: str, level: str):
    common = ["algorithm.rollout_correction.mode=tis", f"algorithm.rollout_correction.level={level}",
              *LAYOUTS[layout]]
    new = _trainer(tmp_path / "new", *common)
    old = _trainer(tmp_path / "old", *common, "algorithm.recompute_logprobs=always")
    try:
        assert new.plan.correction_in_loss and not new.plan.recompute_logprobs
        assert old.plan.recompute_logprobs and not old.plan.correction_in_loss
        batch = new.score(new.generate(new.train_feed.next_batch(4)))
        batch.tensors["scores"] = torch.tensor([0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0])  # advantages +-0.71, not 0
        # On CPU both sides compute identical log-probs; shift the rollout's by U(-0.5, 0.5) per token, as samples
        # of an older policy would be, so ratios spread on both sides of the cap.
        shift = torch.rand(batch["rollout_logprobs"].shape, generator=torch.Generator().manual_seed(0)) - 0.5
        batch.tensors["rollout_logprobs"] = (batch["rollout_logprobs"] + shift) * batch["response_mask"]
        m_new, g_new, b_new = _update(new, Batch(dict(batch.tensors), dict(batch.fields), dict(batch.meta)))
        m_old, g_old, b_old = _update(old, Batch(dict(batch.tensors), dict(batch.fields), dict(batch.meta)))
    finally:
        for t in (new, old):
            t.shutdown()
            t.tracker.close()
    assert "old_logprobs" not in b_new and "is_weights" not in b_new and "correction" not in b_new.meta
    stats_old = {k: b_old.meta["correction"][f"rollout_is/{k}"] for k in STATS}
    stats_new = {k: m_new[f"train/rollout_is/{k}"] for k in STATS}
    assert stats_new == pytest.approx(stats_old, rel=1e-5, abs=1e-6)
    # not vacuous: the rollout's log-probs differ from the trainer's and the cap truncates some weights
    assert stats_new["ratio_max"] > 1.2 and 0 < stats_new["clipped_frac"] < 1
    assert m_new["train/actor/pg_loss"] == pytest.approx(m_old["train/actor/pg_loss"], rel=1e-5, abs=1e-7)
    assert len(g_new) == len(g_old) > 0 and max(float(g.abs().max()) for g in g_new) > 0
    for a, b in zip(g_new, g_old):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    # the recompute pass measured the log-prob gap on the controller; the update measures it the same
    assert m_new["train/rollout_logprob_diff_max"] == pytest.approx(
        float(((b_old["rollout_logprobs"] - b_old["old_logprobs"]).abs() * b_old["response_mask"]).max()), rel=1e-5)
