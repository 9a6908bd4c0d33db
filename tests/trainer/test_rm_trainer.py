"""The reward_model role through the Trainer on the in-process backend: combined scores and metrics, and the
running normaliser saved in checkpoints and carried across a resume."""
import torch

from tests.integration.helpers import train_run

BASE = ("cluster.backend=local", "model.path=tiny:", "data.prompts_per_step=4", "rollout.n=2",
        "rollout.max_new_tokens=2", "trainer.val_every=0", "trainer.val_before_train=false", "data.val=null",
        "rewards.model={path: 'tiny:', normalize: true}", "rewards.combine={default: {rule: 0, model: 1}}")


def _norm_at(out, step):
    return torch.load(out / "checkpoints" / f"step_{step}" / "controller.pt", weights_only=False)["rm_norm"]


def test_rm_only_scores_are_normalised_and_the_normaliser_resumes(tmp_path):
    out = tmp_path / "run"
    records = train_run(None, out, *BASE, "trainer.total_steps=2", "trainer.save_every=2")
    steps = [r for r in records if "train/rm_score_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    # step 1 standardises its 8 scores by their own mean/std: mean 0, (population) std 1
    assert abs(steps[0]["train/reward_mean"]) < 1e-5 and abs(steps[0]["train/reward_std"] - 1) < 1e-4
    assert _norm_at(out, 2)["count"] == 16  # 2 steps × 4 prompts × 2 samples
    train_run(None, out, *BASE, "trainer.total_steps=3", "trainer.save_every=3", "trainer.resume=auto")
    assert _norm_at(out, 3)["count"] == 24  # the resumed run continued from 16, not from 0
