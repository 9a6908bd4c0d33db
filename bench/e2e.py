"""End-to-end GRPO step on GPU(s) through the real trainer: tokens/s/GPU, seconds per phase, peak memory, MFU.

    PYTHONPATH=. python bench/e2e.py --gpus 1 [--engine fast|hf] [--steps 5] [--lengths fixed|longtail]
        [--out DIR] [overrides: algorithm.micro_batch_tokens=16384 actor.fused_logprob_chunk=4096 ...]

Weak scaling: each GPU gets the single-GPU workload (32 prompts × 8 samples × 256 new tokens of the
Qwen2.5-0.5B shape); scaling efficiency at G GPUs = tokens/s/GPU(G) / tokens/s/GPU(1).
tokens/s/GPU = (prompt + response tokens of the step) / step time / GPUs.

--lengths longtail: responses stop at a per-sample length drawn from a seeded lognormal (mean 300 after
clipping at --max-len 1024 new tokens; bench/longtail.py documents the rule); local backend only (1 GPU).
Reported besides: padding waste = 1 - real tokens / token slots of the actor update's forwards (a padded
micro-batch computes B × (longest prompt + longest response) slots, a packed one its real tokens rounded up
to the row alignment); update MFU = `update_flops` / update time / dense bf16 peak (bench/README.md);
peak GPU memory over the whole run, warm-up included (the workers' train/memory/gpu_peak_allocated_gib and, on the
rank-local step, train/memory/generate/gpu_peak_allocated_gib: max over steps, phases and ranks), and each
phase's own peak (`peak_gpu_mem_gib_by_phase`: generate, update).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import longtail  # noqa: E402
from bench.common import matmul_params, peak_bf16_tflops, step_peak  # noqa: E402
from fleetrl.config import derive_plan, load_config  # noqa: E402
from fleetrl.models.shapes import QWEN3, QWEN25, RANDOM_PREFIX, shape_config  # noqa: E402
from fleetrl.trainer.run import run_plan  # noqa: E402

PHASES = ("generate", "score", "logprobs", "update_actor", "sync")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--engine", default="fast")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--config", default="bench/e2e_grpo.yaml")
    ap.add_argument("--lengths", choices=("fixed", "longtail"), default="fixed")
    ap.add_argument("--mean-len", type=float, default=longtail.DEFAULT_MEAN,
                    help="lognormal mean before clipping (335: 300 after)")
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench"))
    ap.add_argument("--tag", default="", help="suffix of the JSON file name (for variants)")
    ap.add_argument("--profile-step", type=int, default=0, help="profile the actor update of this step (1-based; "
                    "local backend): top CUDA kernels by time, grouped, to OUT/e2e_update_profile<tag>.txt")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.profile_step > args.warmup:
        ap.error(f"--profile-step {args.profile_step} falls in the timed steps (--warmup {args.warmup}): the profiler's "
                 f"overhead would count in the figures; profile a warm-up step (1..{args.warmup}) or raise --warmup")
    Path(args.out).mkdir(parents=True, exist_ok=True)  # now, not after the run: the JSON is written at the end
    g = args.gpus
    overrides = [f"rollout.engine={args.engine}", f"trainer.total_steps={args.steps}",
                 f"data.prompts_per_step={32 * g}", f"cluster.pools.main.workers_per_node={g}",
                 f"cluster.backend={'local' if g == 1 else 'ray'}", "tracking.console=false",
                 "trainer.save_last=false"]  # a benchmark is never resumed: no checkpoint of its last step
    if args.lengths == "longtail":
        overrides.append(f"rollout.max_new_tokens={args.max_len}")
    overrides += args.overrides
    run_dir = Path(f"/tmp/fleetrl-e2e-{g}gpu-{args.engine}-{int(time.time())}")
    overrides.append(f"trainer.output_dir={run_dir}")
    plan = derive_plan(load_config(args.config, overrides))
    stats: list[dict] = []
    if g == 1:  # in-process workers: the stop rule and the FLOP counts hook the rollout component
        longtail.install(mean=args.mean_len if args.lengths == "longtail" else None, max_len=args.max_len,
                         seed=plan.config.trainer.seed, stats=stats)
    elif args.lengths == "longtail":
        raise SystemExit("--lengths longtail needs --gpus 1 (the stop rule patches the in-process rollout worker)")
    if args.profile_step:
        profile_update(args.profile_step, Path(args.out) / f"e2e_update_profile{args.tag}.txt")
        profile_generate(args.profile_step, Path(args.out) / f"e2e_generate_profile{args.tag}.txt")
    t0 = time.time()
    run_plan(plan, run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/time/step" in r]
    rows = steps[args.warmup:]
    result = summarize(rows, stats[-len(rows):] if stats else [], plan, args, overrides, t0)
    result["peak_gpu_mem_gib"] = peak_gpu_mem_gib(steps)
    result["peak_gpu_mem_gib_by_phase"] = peak_by_phase(steps)
    out = Path(args.out) / f"e2e_grpo_{g}gpu_{args.engine}{args.tag}.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"e2e GRPO {g} GPU(s), engine={args.engine}, lengths={args.lengths}: {result['step_s']:.2f} s/step, "
          f"{result['tokens_per_s_per_gpu']:.0f} tokens/s/GPU, update MFU {result['update_mfu']}, padding waste "
          f"{result['padding_waste']}; phases " + ", ".join(f"{p}={v:.2f}s" for p, v in result["phases_s"].items()))
    print("RESULT " + json.dumps(result))


def profile_update(step: int, out: Path) -> None:
    """Wraps the in-process actor's update: its `step`-th call runs under the torch profiler, and the CUDA kernel
    time is written to `out`, grouped by kind (GEMM, attention, fused/elementwise, optimiser, copies) and by name."""
    import fleetrl.workers.actor as actor_mod

    actor_mod.run_update = profiled(actor_mod.run_update, step, out)


def profile_generate(step: int, out: Path) -> None:
    """The same for the rollout component's `step`-th generate call (decode, prefill and the host work around)."""
    import fleetrl.workers.rollout as rollout_mod

    cls = rollout_mod.RolloutComponent
    cls.generate = profiled(cls.generate, step, out)


def profiled(inner, step: int, out: Path):  # noqa: ANN001, ANN201
    """`inner` whose `step`-th call runs under the torch profiler: kernel time, GPU idle gaps, a chrome trace."""
    from torch.profiler import ProfilerActivity, profile

    calls = [0]

    def wrapped(*a, **k):  # noqa: ANN002, ANN003, ANN202
        calls[0] += 1
        if calls[0] != step:
            return inner(*a, **k)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            result = inner(*a, **k)
            torch.cuda.synchronize()
        out.write_text(kernel_report(prof) + idle_report(prof))
        trace = out.with_suffix(".trace.json")
        prof.export_chrome_trace(str(trace))  # for the host-side gaps: read it in chrome://tracing or Perfetto
        subprocess.run(["gzip", "-f", str(trace)], check=False)
        print(out.read_text()[:4000])
        return result

    return wrapped


KERNEL_KINDS = (("gemm", ("gemm", "cutlass", "cublas", "sm90_xmma", "nvjet", "matmul")),
                ("attention", ("flash", "fmha", "attention", "flex")), ("optimizer", ("adam", "multi_tensor")),
                ("copy/cast", ("copy", "cast", "convert", "to_copy")), ("triton/fused", ("triton",)))


def is_annotation(e) -> bool:  # noqa: ANN001
    """A record_function range (e.g. engine.py's `engine.decode`) as the profiler mirrors it on the GPU timeline:
    it spans kernels and the gaps between them, so counting it as a kernel hides the GPU's idle time."""
    return bool(e.is_user_annotation)


def device_spans(prof) -> list[tuple[float, float]]:  # noqa: ANN001
    """(start, end) in µs of every kernel, copy and memset the profile recorded, in start order."""
    return sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                  if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start and not is_annotation(e))


def kernel_report(prof) -> str:  # noqa: ANN001
    """Device time by kernel kind and the 30 most expensive kernels (one profiled update)."""
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.self_device_time_total > 0
               and not is_annotation(e)]
    total = sum(e.self_device_time_total for e in kernels)
    kinds: dict[str, float] = {}
    for e in kernels:
        name = e.key.lower()
        kind = next((k for k, keys in KERNEL_KINDS if any(w in name for w in keys)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + e.self_device_time_total
    lines = [f"device time of one update: {total / 1e3:.1f} ms over {sum(e.count for e in kernels)} launches"]
    lines += [f"  {k:14s} {v / 1e3:9.1f} ms  {100 * v / total:5.1f}%" for k, v in sorted(kinds.items(), key=lambda x: -x[1])]
    lines.append("top kernels (ms, launches, name):")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:30]:
        lines.append(f"  {e.self_device_time_total / 1e3:9.2f} {e.count:6d}  {e.key[:140]}")
    return "\n".join(lines) + "\n"


def gpu_gaps(prof) -> tuple[float, float, list[tuple[float, float]]]:  # noqa: ANN001
    """(host window start, end, [(gap length, gap start)]) in µs: the times the GPU ran nothing while the host was
    in the profiled call, before its first kernel, between kernels and after its last. No gaps without kernels."""
    kernels = device_spans(prof)
    host = [e for e in prof.events() if e.device_type.name == "CPU"]
    if not kernels or not host:
        return 0.0, 0.0, []
    t0, t1 = min(e.time_range.start for e in host), max(e.time_range.end for e in host)
    gaps, end = [(kernels[0][0] - t0, t0)], kernels[0][0]
    for s, e in kernels:
        if s > end:
            gaps.append((s - end, end))
        end = max(end, e)
    gaps.append((t1 - end, end))
    return t0, t1, gaps


def idle_report(prof) -> str:  # noqa: ANN001
    """How long the GPU sat idle during the profiled call, and its 15 longest gaps with the host op that was
    running when each began: where the host, not the GPU, set the pace."""
    t0, t1, gaps = gpu_gaps(prof)
    if not gaps:
        return "no kernels or host events recorded\n"
    host = [e for e in prof.events() if e.device_type.name == "CPU"]
    idle = sum(g for g, _ in gaps)
    lines = [f"host window {(t1 - t0) / 1e3:.1f} ms, GPU idle {idle / 1e3:.1f} ms in {len(gaps)} gaps; longest:"]
    for g, at in sorted(gaps, reverse=True)[:15]:
        running = [e for e in host if e.time_range.start <= at < e.time_range.end]
        name = min(running, key=lambda e: e.time_range.end - e.time_range.start).name if running else "?"
        outer = max(running, key=lambda e: e.time_range.end - e.time_range.start).name if running else "?"
        lines.append(f"  {g / 1e3:8.2f} ms at +{(at - t0) / 1e3:8.1f} ms  innermost {name[:70]}  outermost {outer[:50]}")
    return "\n".join(lines) + "\n"


def summarize(rows: list[dict], stats: list[dict], plan, args, overrides: list[str], t0: float) -> dict:  # noqa: ANN001
    g = args.gpus
    step = statistics.mean(r["train/time/step"] for r in rows)
    tokens = statistics.mean(r["train/tokens_per_s"] * r["train/time/step"] for r in rows)
    phases = {p: statistics.mean(r.get(f"train/time/{p}", 0.0) for r in rows) for p in PHASES}
    real = sum(r.get("train/actor/tokens_real", 0.0) for r in rows)
    slots = sum(r.get("train/actor/tokens_slots", 0.0) for r in rows)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return {
        "bench": "e2e_grpo", "gpus": g, "engine": args.engine, "lengths": args.lengths,
        "date": time.strftime("%Y-%m-%d"), "device": device,
        "workload": {"model": plan.config.model.path, "prompts_per_step": plan.config.data.prompts_per_step,
                     "n": plan.config.rollout.n, "max_new_tokens": plan.config.rollout.max_new_tokens,
                     "mean_response_tokens": (statistics.mean(s["response_tokens"] / s["samples"] for s in stats)
                                              if stats else None),
                     "max_response_tokens": max((s["max_response"] for s in stats), default=None),
                     "micro_batch_tokens": plan.micro_batch_tokens, "micro_batch_size": plan.micro_batch_size,
                     "fused_logprob_chunk": plan.config.actor.fused_logprob_chunk},
        "step_s": step, "steps_s": [round(r["train/time/step"], 4) for r in rows],
        "update_s": [round(r.get("train/time/update_actor", 0.0), 4) for r in rows],
        "tokens_per_step": tokens, "tokens_per_s_per_gpu": tokens / step / g, "phases_s": phases,
        "generate_parts_s": _generate_parts(rows), "steps_generate_s": [round(r.get("train/time/generate", 0.0), 4)
                                                                        for r in rows],
        "padding_waste": round(1 - real / slots, 4) if slots else None,
        "update_mfu": _update_mfu(stats or _fixed_length_stats(tokens, plan), phases["update_actor"],
                                  plan.config.model.path, device, g, body_tokens=real / len(rows) if real else None),
        "rollout_logprob_diff_mean": statistics.mean(r.get("train/rollout_logprob_diff_mean", 0.0) for r in rows),
        # the step's data path (trainer.rank_local: the samples stay on their rank; the score phase then runs
        # inside generate, timed by the slowest rank) and what the controller costs: Ray's share of the calls'
        # wall time, the per-sample bytes through the driver, and each verb's per-rank seconds (rank skew)
        "rank_local": plan.rank_local,
        "worker_call_overhead_s": statistics.mean(r.get("train/time/worker_call_overhead", 0.0) for r in rows),
        "driver_bytes_per_step": statistics.mean(sum(v for k, v in r.items() if k.startswith("train/driver/bytes_"))
                                                 for r in rows),
        "rank_s": {k.removeprefix("train/time/rank/"): statistics.mean(r[k] for r in rows if k in r)
                   for k in sorted({k for r in rows for k in r if k.startswith("train/time/rank/")})},
        "wall_s": time.time() - t0, "overrides": overrides, "tag": args.tag,
    }


def _generate_parts(rows: list[dict]) -> dict[str, float]:
    """Mean seconds of the generate phase's parts timed inside a worker (train/time/generate/*: the optimiser's
    offload and onload, FSDP2's unshard, the rollout itself), for the steps that logged them."""
    keys = sorted({k for r in rows for k in r if k.startswith("train/time/generate/")})
    return {k.removeprefix("train/time/generate/"): statistics.mean(r[k] for r in rows if k in r) for k in keys}


def peak_gpu_mem_gib(steps: list[dict]) -> float | None:
    """The largest per-step peak the workers logged. Not this process's torch.cuda.max_memory_allocated: the
    workers reset it at every update report (workers/memory.py), and on the Ray backend this process holds no
    model. What this process allocated after the last report still counts in the local backend."""
    logged = [m for m in map(step_peak, steps) if m is not None]
    if torch.cuda.is_available():
        logged.append(torch.cuda.max_memory_allocated() / 2**30)
    return max(logged, default=None)


def peak_by_phase(steps: list[dict]) -> dict[str, float]:
    """The workers' logged peaks per phase, max over steps and ranks: `generate` (the rollout, read when generation
    ends) and `update` (the rest of the step, read at the update report)."""
    keys = {"generate": "train/memory/generate/gpu_peak_allocated_gib", "update": "train/memory/gpu_peak_allocated_gib"}
    return {phase: max(r[k] for r in steps if k in r) for phase, k in keys.items() if any(k in r for r in steps)}


def _fixed_length_stats(tokens: float, plan) -> list[dict]:  # noqa: ANN001
    """The rollout's token counts when it ran in Ray workers (no in-process stats): with fixed lengths every
    sequence has the same length, so Σ len² = samples × (tokens / samples)² exactly."""
    samples = plan.samples_per_step
    return [{"tokens": tokens, "sum_len_sq": samples * (tokens / samples) ** 2,
             "response_tokens": samples * plan.config.rollout.max_new_tokens}]


def update_flops(body_params: int, head_params: int, attn_per_pair: int, body_tokens: float, response_tokens: float,
                 sum_len_sq: float) -> float:
    """Model FLOPs of one forward + backward: 6 per parameter per token, the decoder body over every token the
    forward computes (a shared prompt once), the LM head over the response tokens only (every forward of ours
    applies it there alone), and causal attention at `attn_per_pair` per (query, key) pair summed as Σ len²
    (with shared prompts an upper bound: a prompt's own pairs counted per sample, under 0.5% here)."""
    return 6 * body_params * body_tokens + 6 * head_params * response_tokens + attn_per_pair * sum_len_sq


def _update_mfu(stats: list[dict], update_s: float, model_path: str, device: str, gpus: int,
                body_tokens: float | None = None) -> float | None:
    """PaLM-style MFU of the actor update per GPU (`update_flops`); gradient checkpointing's recomputed forward
    is not counted (model FLOPs, not hardware FLOPs). body_tokens: the tokens the actor's forward computed per
    step (its tokens_real metric; fewer than the rollout's with shared prompts), else the rollout's."""
    peak = peak_bf16_tflops(device)
    name = model_path.removeprefix(RANDOM_PREFIX)
    if not stats or not peak or update_s <= 0 or name not in (*QWEN25, *QWEN3):
        return None
    from transformers import AutoModelForCausalLM

    cfg = shape_config(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
        n, head = matmul_params(model), model.get_output_embeddings().weight.numel()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attn = 12 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim
    flops = statistics.mean(update_flops(n - head, head, attn, body_tokens or s["tokens"], s["response_tokens"],
                                         s["sum_len_sq"]) for s in stats)
    return round(flops / update_s / gpus / (peak * 1e12), 4)


if __name__ == "__main__":
    main()
