"""Each estimator must LEARN the synthetic copy task on CPU: held-out greedy success from < 20% to > 80%
within a fixed step budget, through the real Ray workers."""
import pytest

from tests.integration.helpers import train_run, val_curve

pytestmark = pytest.mark.slow

# Budgets from measured curves (val every 10 steps, seed 0, 2026-11-23): the GRPO family passes 0.8 by step 60-80
# (at 80: grpo 1.0, rloo 0.99, reinforce++ 0.93, gspo 1.0); PPO+GAE by step 110 (0.88 at 120).
COMMON = ("trainer.total_steps=80", "trainer.val_every=20")

CASES = {
    "grpo": ("examples/quickstart.yaml", COMMON),
    "rloo": ("examples/quickstart.yaml", (*COMMON, "algorithm.advantage=rloo")),
    # REINFORCE++ has no per-group baseline and learns slower, by how much depends on the CPU's kernels: 0.93 at step
    # 80 on an AVX-512 Intel host, 0.71 at 80 and 1.0 from 100 on an AVX2-only AMD one (2026-11-26), so 120 steps.
    "reinforce_plus_plus": ("examples/quickstart.yaml", ("trainer.total_steps=120", "trainer.val_every=20",
                                                         "algorithm.advantage=reinforce_plus_plus")),
    # The Qwen3 family (q/k norms) through its fast paths: the fast rollout engine and the native training forward.
    "grpo_qwen3_fast_native": ("examples/quickstart.yaml", (*COMMON, "model.path=tiny:hidden=128,arch=qwen3",
                                                            "rollout.engine=fast", "actor.forward=native")),
    "ppo_gae_critic": ("examples/ppo_tiny.yaml", ("trainer.total_steps=120",)),
    # GSPO with the paper's clip range and aggregation; two mini-batches per step, so the second update is
    # off-policy and the sequence-level ratio and clipping are actually exercised (on-policy the ratio is 1).
    "gspo": ("examples/quickstart.yaml", (*COMMON, "algorithm.policy_loss=gspo", "algorithm.clip_low=0.0003",
                                          "algorithm.clip_high=0.0004", "algorithm.loss_agg=seq-mean-token-mean",
                                          "algorithm.mini_batch_prompts=16")),
}


# The ratio-based cases run in test_learning_ratio.py: a second module, so xdist (--dist loadfile) runs the two
# halves of this ~8-minute set in parallel.
RATIO_CASES = ("ppo_gae_critic", "gspo")


@pytest.mark.parametrize("name", [n for n in CASES if n not in RATIO_CASES])
def test_estimator_learns(name, tmp_path, ray_local):
    check_learns(name, tmp_path)


def check_learns(name: str, tmp_path) -> None:  # noqa: ANN001
    config, overrides = CASES[name]
    curve = val_curve(train_run(config, tmp_path / name, *overrides))
    assert curve[0] < 0.2, f"{name}: initial held-out success {curve[0]} should start below 20%"
    assert curve[-1] > 0.8, f"{name}: held-out success curve {curve} did not pass 80%"
