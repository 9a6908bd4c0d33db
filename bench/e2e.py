"""End-to-end GRPO step on GPU(s) through the real trainer: tokens/s/GPU and seconds per phase.

    PYTHONPATH=. python bench/e2e.py --gpus 1 [--engine fast|hf] [--steps 5] [--out DIR]

Weak scaling: each GPU gets the single-GPU workload (32 prompts × 8 samples × 256 new tokens of the
Qwen2.5-0.5B shape); scaling efficiency at G GPUs = tokens/s/GPU(G) / tokens/s/GPU(1).
tokens/s/GPU = (prompt + response tokens of the step) / step time / GPUs.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from fleetrl.config import derive_plan, load_config
from fleetrl.trainer.run import run_plan

PHASES = ("generate", "score", "logprobs", "update_actor", "sync")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--engine", default="fast")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--config", default="bench/e2e_grpo.yaml")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench"))
    ap.add_argument("--tag", default="", help="suffix of the JSON file name (for variants)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    g = args.gpus
    overrides = [f"rollout.engine={args.engine}", f"trainer.total_steps={args.steps}",
                 f"data.prompts_per_step={32 * g}", f"cluster.pools.main.workers_per_node={g}",
                 f"cluster.backend={'local' if g == 1 else 'ray'}", "tracking.console=false", *args.overrides]
    run_dir = Path(f"/tmp/fleetrl-e2e-{g}gpu-{args.engine}-{int(time.time())}")
    overrides.append(f"trainer.output_dir={run_dir}")
    plan = derive_plan(load_config(args.config, overrides))
    t0 = time.time()
    run_plan(plan, run_dir)
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train/time/step" in r][args.warmup:]
    step = statistics.mean(r["train/time/step"] for r in rows)
    tokens = statistics.mean(r["train/tokens_per_s"] * r["train/time/step"] for r in rows)
    result = {
        "bench": "e2e_grpo", "gpus": g, "engine": args.engine, "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "workload": {"model": plan.config.model.path, "prompts_per_step": plan.config.data.prompts_per_step,
                     "n": plan.config.rollout.n, "max_new_tokens": plan.config.rollout.max_new_tokens},
        "step_s": step, "tokens_per_step": tokens, "tokens_per_s_per_gpu": tokens / step / g,
        "phases_s": {p: statistics.mean(r.get(f"train/time/{p}", 0.0) for r in rows) for p in PHASES},
        "rollout_logprob_diff_mean": statistics.mean(r["train/rollout_logprob_diff_mean"] for r in rows),
        "wall_s": time.time() - t0, "overrides": overrides, "tag": args.tag,
    }
    out = Path(args.out) / f"e2e_grpo_{g}gpu_{args.engine}{args.tag}.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"e2e GRPO {g} GPU(s), engine={args.engine}: {step:.2f} s/step, "
          f"{result['tokens_per_s_per_gpu']:.0f} tokens/s/GPU; phases " +
          ", ".join(f"{p}={v:.2f}s" for p, v in result["phases_s"].items()))


if __name__ == "__main__":
    main()
