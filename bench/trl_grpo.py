"""Baseline for the end-to-end GRPO step benchmark: TRL's GRPOTrainer on the same workload as bench/e2e.py.

    PYTHONPATH=. python bench/trl_grpo.py --mode generate|paged [--steps 4] [--out FILE]
    PYTHONPATH=. python bench/trl_grpo.py --model tiny: --steps 2 --prompts 4 --generations 2 \
        --completion-len 8 --prompt-len 16 --out /tmp/trl_grpo_generate.json   # CPU smoke test

Workload (per GPU, one optimiser step per generation batch): a random-init model of the Qwen2.5-0.5B shape in
bf16, 32 plain-text prompts of ~128 tokens × 8 generations × exactly 256 new tokens (EOS suppressed), temperature
1.0, beta=0 (no reference model), num_iterations=1, seeded random rewards, AdamW lr 1e-6, constant schedule,
grad clip 1.0, no gradient checkpointing, micro-batch 16 samples (bench/e2e_grpo.yaml's settings).

Modes:
  generate  TRL's default rollout: `model.generate` on the left-padded generation batch.
  paged     GRPOConfig(use_transformers_continuous_batching=True): transformers' continuous-batching engine with a
            paged KV cache (`model.generate_batch`). The older name `use_transformers_paged` is a deprecated alias.

Timing: a TrainerCallback takes the (CUDA-synchronised) wall time from on_step_begin to on_step_end of each
optimiser step; the first `--warmup` steps are dropped. tokens/s/GPU = (prompt + completion tokens of the step,
summed over all processes, as TRL counts them in state.num_input_tokens_seen) / step time / GPUs.
Multi-GPU (accelerate launch / torchrun) runs weak scaling: each process gets the per-GPU workload.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

# Common English words: prompts are random sequences of these (any text works; only the token count matters).
WORDS = (
    "the of and to in is was for on that with as by at from his her it an were are which this be or has had "
    "one not but their they new after who its first two been also have other more time into school only city "
    "year over under people world during most would where while some many state than when between these three "
    "river north south east west house water light music game table paper garden window market village story "
    "number system family mountain island station letter morning evening summer winter country company history "
    "language science animal forest bridge street church castle valley ocean season engine machine picture "
    "student teacher doctor farmer painter writer player singer driver builder keeper runner reader"
).split()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("generate", "paged"), default="generate")
    ap.add_argument("--model", default="random:qwen2.5-0.5b",
                    help="fleetrl model name: random:qwen2.5-0.5b (benchmark) or tiny: (CPU smoke test)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--steps", type=int, default=4, help="optimiser steps to run (the first --warmup are dropped)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=32, help="prompts per optimiser step per GPU")
    ap.add_argument("--generations", type=int, default=8, help="completions per prompt (GRPO group size)")
    ap.add_argument("--prompt-len", type=int, default=128, help="target prompt length in tokens")
    ap.add_argument("--completion-len", type=int, default=256, help="new tokens per completion (EOS suppressed)")
    ap.add_argument("--micro-batch", type=int, default=16, help="samples per forward/backward per GPU")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--gradient-checkpointing", action="store_true",
                    help="TRL defaults to on; off here to match bench/e2e_grpo.yaml")
    ap.add_argument("--cb-config", default=None,
                    help="paged mode: JSON of ContinuousBatchingConfig kwargs (TRL sets max_memory_percent=0.5)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None,
                    help="JSON path (default $OUT/trl_grpo_<mode>.json, else bench/trl_grpo_<mode>.json)")
    return ap.parse_args(argv)


def make_prompts(tokenizer: Any, n: int, target: int, seed: int) -> tuple[list[str], list[int]]:
    """n seeded random-word prompts, each target tokens (±2) long as TRL will tokenize it (tokenizer(text))."""
    rng = random.Random(seed)
    texts, lengths = [], []

    def ntok(words: list[str]) -> int:
        return len(tokenizer(" ".join(words))["input_ids"])

    for _ in range(n):
        words: list[str] = []
        while ntok(words) < target:
            words.append(rng.choice(WORDS))
        if len(words) > 1 and abs(ntok(words[:-1]) - target) < abs(ntok(words) - target):
            words.pop()
        text = " ".join(words)
        texts.append(text)
        lengths.append(ntok(words))
    return texts, lengths


def versions() -> dict[str, str]:
    import datasets
    import transformers
    import trl

    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "trl": trl.__version__, "datasets": datasets.__version__}
    try:
        import accelerate
        out["accelerate"] = accelerate.__version__
    except ImportError:
        pass
    return out


def device_info() -> dict[str, Any]:
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return {"device": "cuda", "device_name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                "cuda": torch.version.cuda, "visible_gpus": torch.cuda.device_count()}
    return {"device": "cpu", "device_name": platform.processor() or platform.machine()}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def default_out(mode: str) -> Path:
    base = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(__file__).resolve().parent
    return base / f"trl_grpo_{mode}.json"


def run(args: argparse.Namespace, result: dict[str, Any]) -> None:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from fleetrl.models.hf import load_causal_lm, load_tokenizer

    fields = getattr(GRPOConfig, "__dataclass_fields__", {})
    if args.mode == "paged" and "use_transformers_continuous_batching" not in fields:
        raise RuntimeError("--mode paged needs GRPOConfig.use_transformers_continuous_batching, which this TRL "
                           "version does not have (TRL 1.16 has it; older ones call it use_transformers_paged)")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    samples = args.prompts * args.generations  # per GPU per optimiser step
    micro = min(args.micro_batch, samples)
    if samples % micro:
        raise ValueError(f"prompts×generations={samples} is not a multiple of --micro-batch {micro}")
    grad_accum = samples // micro

    tokenizer = load_tokenizer(args.model)
    model = load_causal_lm(args.model, dtype=args.dtype)
    # No stop token on the model side; the tokenizer's EOS (which TRL always adds to its stop list) is suppressed
    # below, so every completion runs to exactly max_completion_length tokens.
    model.generation_config.eos_token_id = None
    stop_ids = sorted({i for i in (tokenizer.eos_token_id, getattr(model.config, "eos_token_id", None))
                       if isinstance(i, int)})

    n_prompts = args.prompts * world * args.steps  # fresh prompts for every step
    texts, lengths = make_prompts(tokenizer, n_prompts, args.prompt_len, args.seed)
    dataset = Dataset.from_dict({"prompt": texts, "prompt_tokens": lengths})

    completion_stats: list[int] = []  # completion lengths this process saw (reward-function side)
    reward_rng = random.Random(args.seed + 1 + int(os.environ.get("RANK", "0")))

    def random_reward(completions: list[Any], completion_ids: list[list[int]], **_: Any) -> list[float]:
        completion_stats.extend(len(c) for c in completion_ids)
        return [reward_rng.random() for _ in completions]

    cuda = torch.cuda.is_available()
    cb_config = json.loads(args.cb_config) if args.cb_config else None
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-grpo-bench-"),
        # batch: ONE optimiser step per generation batch of prompts×generations completions per GPU
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=grad_accum,  # steps_per_generation defaults to this -> generation batch = step
        num_generations=args.generations,
        num_iterations=1,
        max_steps=args.steps,
        # generation
        max_completion_length=args.completion_len,
        temperature=args.temperature,
        top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0,
        generation_kwargs={"suppress_tokens": stop_ids},  # no EOS -> fixed-length completions (also honoured by CB)
        use_transformers_continuous_batching=(args.mode == "paged"),
        transformers_continuous_batching_config=cb_config,
        # loss / optimiser
        beta=0.0,  # no reference model is built
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch_fused" if cuda else "adamw_torch",
        bf16=(args.dtype in ("bfloat16", "bf16")),
        use_cpu=not cuda,
        gradient_checkpointing=args.gradient_checkpointing,
        # no logging / saving / eval overhead
        report_to="none",
        logging_strategy="no",
        logging_steps=10**9,
        save_strategy="no",
        eval_strategy="no",
        log_completions=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=args.seed,
    )

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.steps: list[dict[str, float]] = []
            self._t0 = 0.0
            self._tok0 = 0
            self._n0 = 0

        def on_step_begin(self, args_, state, control, **kw):  # noqa: ANN001, ANN003
            sync()
            self._tok0, self._n0 = state.num_input_tokens_seen, len(completion_stats)
            self._t0 = time.perf_counter()

        def on_step_end(self, args_, state, control, **kw):  # noqa: ANN001, ANN003
            sync()
            dt = time.perf_counter() - self._t0
            lens = completion_stats[self._n0:]
            self.steps.append({"step_s": dt, "tokens": state.num_input_tokens_seen - self._tok0,
                               "completions": len(lens), "completion_len_min": min(lens, default=0),
                               "completion_len_max": max(lens, default=0)})
            if trainer.accelerator.is_main_process:
                print(f"[trl_grpo {args.mode}] step {state.global_step}: {dt:.3f} s, "
                      f"{self.steps[-1]['tokens']} tokens", flush=True)

    timer = StepTimer()
    trainer = GRPOTrainer(model=model, reward_funcs=random_reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[timer])

    # Optional breakdown: wall time spent in the rollout (TRL's private _generate_single_turn; skipped if absent).
    gen_times: list[float] = []
    inner = getattr(trainer, "_generate_single_turn", None)
    if inner is not None:
        def timed_generate(*a: Any, **kw: Any) -> Any:
            sync()
            t0 = time.perf_counter()
            out = inner(*a, **kw)
            sync()
            gen_times.append(time.perf_counter() - t0)
            return out
        trainer._generate_single_turn = timed_generate

    gpus = trainer.accelerator.num_processes if cuda else 1
    result["workload"].update(
        gpus=gpus, global_prompts_per_step=args.prompts * gpus, micro_batch=micro, grad_accum=grad_accum,
        prompt_tokens_min=min(lengths), prompt_tokens_max=max(lengths),
        prompt_tokens_mean=statistics.mean(lengths), suppressed_token_ids=stop_ids)
    result["grpo_config"] = {k: getattr(config, k) for k in (
        "per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation", "generation_batch_size",
        "num_generations", "num_iterations", "max_completion_length", "temperature", "beta", "loss_type",
        "scale_rewards", "learning_rate", "optim", "bf16", "gradient_checkpointing", "max_grad_norm",
        "use_transformers_continuous_batching", "transformers_continuous_batching_config", "generation_kwargs")}
    result["grpo_config"]["optim"] = str(result["grpo_config"]["optim"])
    result["has_ref_model"] = getattr(trainer, "ref_model", None) is not None

    t0 = time.perf_counter()
    trainer.train()
    result["wall_s"] = time.perf_counter() - t0

    steps = timer.steps
    if len(steps) <= args.warmup:
        raise RuntimeError(f"only {len(steps)} optimiser steps ran; need more than --warmup {args.warmup}")
    timed = steps[args.warmup:]
    step_s = statistics.mean(s["step_s"] for s in timed)
    tokens = statistics.mean(s["tokens"] for s in timed)
    gen = gen_times[args.warmup:] if len(gen_times) == len(steps) else []
    result["steps"] = steps
    result["results"] = {
        "timed_steps": len(timed), "step_s": step_s, "step_s_min": min(s["step_s"] for s in timed),
        "step_s_max": max(s["step_s"] for s in timed), "tokens_per_step": tokens,
        "tokens_per_s_per_gpu": tokens / step_s / gpus,
        "generate_s": statistics.mean(gen) if gen else None,
        "completion_len_min": min(s["completion_len_min"] for s in timed),
        "completion_len_max": max(s["completion_len_max"] for s in timed),
    }
    if cuda:
        result["results"]["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)


def print_table(result: dict[str, Any]) -> None:
    r, w = result.get("results") or {}, result["workload"]
    rows = [("mode", result["mode"]), ("model", w["model"]), ("device", result.get("device_name")),
            ("prompts × generations", f"{w['prompts_per_step']} × {w['generations']}"),
            ("prompt / completion tokens", f"~{w['prompt_len']} / {w['completion_len']}"),
            ("timed steps", r.get("timed_steps")), ("s / optimiser step", r.get("step_s")),
            ("  of which generate (s)", r.get("generate_s")), ("tokens / step", r.get("tokens_per_step")),
            ("tokens / s / GPU", r.get("tokens_per_s_per_gpu")),
            ("completion len min..max", f"{r['completion_len_min']}..{r['completion_len_max']}" if r else None),
            ("error", result.get("error"))]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        if v is None:
            continue
        print(f"| {k.ljust(width)} | {f'{v:.4g}' if isinstance(v, float) else v} |")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out) if args.out else default_out(args.mode)
    result: dict[str, Any] = {
        "bench": "trl_grpo", "mode": args.mode,
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        **device_info(), "versions": {},
        "workload": {"model": args.model, "dtype": args.dtype, "prompts_per_step": args.prompts,
                     "generations": args.generations, "prompt_len": args.prompt_len,
                     "completion_len": args.completion_len, "micro_batch": args.micro_batch, "lr": args.lr,
                     "temperature": args.temperature, "beta": 0.0, "num_iterations": 1, "steps": args.steps,
                     "warmup_steps_dropped": args.warmup, "seed": args.seed},
    }
    rc = 0
    try:
        result["versions"] = versions()
        run(args, result)
    except Exception as err:  # noqa: BLE001 - record any failure in the JSON, then exit non-zero
        traceback.print_exc()
        result["error"] = f"{type(err).__name__}: {err}"
        result["traceback"] = traceback.format_exc()[-4000:]
        rc = 1
    if int(os.environ.get("RANK", "0")) == 0:
        print_table(result)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2, default=str))
        print(f"wrote {out}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
