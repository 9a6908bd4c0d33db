"""Asynchronous vs synchronous GRPO through the real trainer and Ray workers (issues 15 and 38).

Modes (the pools of cluster.pools; async modes run trainer.mode=async, max_staleness 1, truncated IS
(algorithm.rollout_correction.mode=tis)):

    sync     one pool of all GPUs: actor world G, rollout colocated (generate, then train, on every GPU)
    async    2 GPUs: a rollout pool of 1 GPU generating while an actor pool of 1 GPU trains (issue 15)
    async13  4 GPUs: rollout pool 1 GPU, actor pool 3 GPUs (FSDP2 over 3)
    async22  4 GPUs: rollout pool 2 GPUs, actor pool 2 GPUs (FSDP2 over 2)
    asyncs, async13s, async22s   the same splits with the rollout worker's calls streamed through one engine loop
             that takes up new weights between decode rounds (trainer.stream_rollouts, fast engine)

Workloads (--gpus picks one; long-tailed response lengths of bench/longtail.py, applied inside every Ray worker
through Ray's worker_process_setup_hook):

    --gpus 2  Qwen2.5-0.5B shape (random init, bf16: bench/e2e_grpo.yaml), 64 prompts × 8 samples, mean 300 / max
              1,024 response tokens (issue 15)
    --gpus 4  Qwen3-8B shape (--shape qwen2.5-7b also), 64 prompts × 8 samples, mean ~1,000 / max 4,096 response
              tokens (issue 38, NeMo-RL's recipe shape: 2,048 samples of mean ~1,019 tokens at max 4,096); FSDP2 actor,
              native compiled forward, packed shared-prompt micro-batches of 8,192 tokens (gpu_suite.sh e2e7b4)

Reported per mode (printed as RESULT lines, one JSON file each): tokens/s/GPU = (prompt + response tokens) / wall
time of the measured steps / GPUs; each pool's idle fraction of that time:

    sync   pool idle = 1 - (generate + logprobs + update_actor + sync) / step   (every GPU runs every phase)
    async  actor idle = 1 - (logprobs + update_actor + sync) / step; rollout idle = gaps between a rollout
           worker's generate calls (train/async/rollout_idle_s, summed over workers) / (step × rollout workers)

and in async modes the staleness histogram (train/async/staleness_count/j summed over the measured steps), the
weight-sync seconds (train/time/sync: actor rank 0 gathers and puts the state in the object store; the rollout
workers' install runs inside their generate calls) and the importance weights (train/rollout_is/*). The summary
gives each async split's speedup over sync beside NeMo-RL's published figures.

Memory: the fast engine's KV cache is static (slots × (prompt + max_new_tokens) positions, engines/fast/engine.py)
and the Plan gives it one slot per sample of a call. At 4,096 new tokens that does not fit an 8B shape: 128 slots
of Qwen3-8B are 81 GB. `engine_slots` picks the slots the estimated free memory holds and the run asks for them
with rollout.gpu_memory_fraction (continuous batching then admits waiting prompts as slots free up); --slots
overrides the estimate. async13 trains 66 prompts a step: the Plan
deals whole groups, as many to each of the 3 actor ranks.

Time on a 4-GPU host (estimates from the 7B 4-GPU run and the Qwen3-8B decode figures in bench/RESULTS.md; no
4-GPU run of this workload yet): start-up ~45 s, the first step's compile ~20 s more. A sync step of Qwen3-8B:
generate 25-40 s (a 4,096-token tail of sequential decode steps at 5-8 ms; 71 of 128 slots on an H100) + update
~15 s (~520k tokens over 4 GPUs) + the optimiser's host round trip ~4 s. async22: 256 samples per rollout GPU
(84 slots on an H100, 179 on an H200) 35-50 s, against an update over 2 GPUs of ~33 s + the weight publish (16 GB
gathered to the host and put in the object store) ~8 s. async13: 528 samples on one rollout GPU, 45-70 s a step.
So one 10-minute call holds sync + one async split at 1 measured step each (gpu_suite.sh async4); each mode alone
holds 2 (async4sync, async4a13, async4a22). --mode-timeout stops a mode and still reports its measured steps.

    PYTHONPATH=. python bench/async_e2e.py [--gpus 2|4] [--modes sync,async22] [--shape qwen3-8b] [--steps 2]
        [--warmup 1] [--mode-timeout S] [--slots N] [--out DIR] [key=value ...]
    PYTHONPATH=. python bench/async_e2e.py --summary --gpus 4 --out DIR   # the summary of the JSON files in DIR
    PYTHONPATH=. python bench/async_e2e.py --smoke [--gpus 4 --modes sync,async13,async22]   # CPU, tiny model
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import longtail  # noqa: E402
from fleetrl.config import Plan, derive_plan, load_config  # noqa: E402
from fleetrl.trainer.run import run_plan  # noqa: E402

ENV = "FLEETRL_BENCH_LONGTAIL"  # "mean,max_len,seed" for the worker hook
# NeMo-RL v0.5, Llama-3.1-8B GRPO on 16x H100, 2,048 samples a step, max sequence 4,096 (issue 38).
NEMO_RL_TOKENS_PER_S_PER_GPU = {"on-policy": 1581, "one-step off-policy": 2478}
# mode -> (rollout GPUs, actor GPUs); an "s" suffix streams the rollout worker's calls (trainer.stream_rollouts)
SPLITS = {"async": (1, 1), "async13": (1, 3), "async22": (2, 2), "asyncs": (1, 1), "async13s": (1, 3),
          "async22s": (2, 2)}
STREAMED = ("trainer.stream_rollouts=true", "rollout.engine=fast")
ASYNC = ("trainer.mode=async", "trainer.max_staleness=1", "algorithm.rollout_correction.mode=tis")
# 8B on 4 GPUs: gpu_suite.sh e2e7b4's stack (bench/RESULTS.md "7B on 4 GPUs"). micro_batch_size only has to
# divide each rank's samples (66 prompts over 3 ranks: 176), packing goes by the token budget.
BIG = ("actor.sharding=fsdp2", "actor.forward=native", "actor.compile=true", "algorithm.micro_batch_tokens=8192",
       "actor.share_prompts=true", "algorithm.micro_batch_size=8", "cluster.init_timeout_s=400")
# Colocated, the optimiser state leaves the GPU while the engine's KV cache is there (free for the update).
SYNC_BIG = ("actor.offload_optimizer=true",)
SMOKE = ["model.path=tiny:", "model.dtype=float32", "rollout.engine=hf", "data.prompts_per_step=8", "rollout.n=4",
         "data.train=synthetic:copy?n=200", "rewards.sources={}", "algorithm.micro_batch_size=16",
         "data.max_prompt_length=32"]  # the copy task's own scorer; lorem prompts are long for the tiny model
# The 4-worker smoke's stand-in for BIG: the same FSDP2 actor, native forward and packed shared-prompt rows (gloo on
# CPU), so the async splits' sharded gather and object-store publish run here; uncompiled (Inductor on 2 cores).
SMOKE_BIG = ("actor.sharding=fsdp2", "actor.forward=native", "algorithm.micro_batch_tokens=256",
             "actor.share_prompts=true")


@dataclasses.dataclass(frozen=True)
class Workload:
    shape: str
    mean_len: float  # the lognormal's mean before clipping at max_len (bench/longtail.py)
    max_len: int
    modes: str
    settings: tuple[str, ...]


WORKLOADS = {2: Workload("qwen2.5-0.5b", 335.0, 1024, "sync,async", ()),
             # mean 1,080 before clipping at 4,096 gives ~1,000 after (sigma 1: 3.3% of responses clipped)
             4: Workload("qwen3-8b", 1080.0, 4096, "sync,async22", BIG)}


def worker_setup() -> None:
    """Ray worker_process_setup_hook: the long-tailed stop rule (bench/longtail.py) in every worker process."""
    spec = os.environ.get(ENV)
    if spec:
        mean, max_len, seed = spec.split(",")
        longtail.install(mean=float(mean), max_len=int(max_len), seed=int(seed), stats=[])


# ------------------------------------------------------------------------------------------ configs
def split_of(mode: str, gpus: int) -> tuple[int, int] | None:
    """(rollout GPUs, actor GPUs) of an async mode, None for sync; SystemExit for a mode this host size lacks."""
    if mode == "sync":
        return None
    split = SPLITS.get(mode)
    if split is None or sum(split) != gpus:
        fits = [m for m, s in SPLITS.items() if sum(s) == gpus]
        raise SystemExit(f"mode {mode!r} does not split {gpus} GPUs; choose sync or one of {fits}")
    return split


def whole_groups(prompts: int, world: int) -> int:
    """The smallest multiple of the actor world >= `prompts`: the Plan deals whole GRPO groups, as many to each
    rank, so 64 prompts do not split over 3 actor ranks (async13 trains 66; tokens/s/GPU compares per token)."""
    return -(-prompts // world) * world


def pool_overrides(mode: str, gpus: int, smoke: bool) -> list[str]:
    """cluster.pools/roles (and the async settings) of `mode`. On CPU (smoke) the same worker counts, a fraction
    of a core each, so the 4-GPU layouts run end to end on a 2-core machine."""
    res = f"cpus_per_worker: {1 / gpus}" if smoke else "gpus_per_worker: 1, cpus_per_worker: 2"
    split = split_of(mode, gpus)
    if split is None:
        return [f"cluster.pools={{main: {{workers_per_node: {gpus}, {res}}}}}",
                "cluster.roles={actor: main, rollout: main}"]
    gen, train = split
    return [f"cluster.pools={{train: {{workers_per_node: {train}, {res}}}, gen: {{workers_per_node: {gen}, {res}}}}}",
            "cluster.roles={actor: train, rollout: gen}", *ASYNC]


def mode_overrides(mode: str, args: argparse.Namespace, run_dir: Path) -> list[str]:
    split = split_of(mode, args.gpus)
    model = SMOKE if args.smoke else [f"model.path=random:{args.shape}"]
    prompts = whole_groups(8 if args.smoke else 64, split[1] if split else args.gpus)
    return [f"trainer.total_steps={args.warmup + args.steps}", f"rollout.max_new_tokens={args.max_len}",
            "cluster.backend=ray", "tracking.console=false",
            "trainer.save_last=false",  # a benchmark is never resumed: no checkpoint of its last step
            *pool_overrides(mode, args.gpus, args.smoke), *model, f"data.prompts_per_step={prompts}",
            *training_stack(split is None, args), *(STREAMED if mode.endswith("s") and split else ()),
            f"trainer.output_dir={run_dir}", *args.overrides]


def training_stack(colocated: bool, args: argparse.Namespace) -> tuple[str, ...]:
    """The actor's settings: the 4-GPU workload's (BIG, with SYNC_BIG colocated) or their CPU stand-in."""
    if args.smoke:
        return SMOKE_BIG if args.gpus > 2 else ()
    big = WORKLOADS[args.gpus].settings
    return (*big, *SYNC_BIG) if big and colocated else big


def mode_plan(mode: str, args: argparse.Namespace, run_dir: Path, *extra: str) -> Plan:
    return derive_plan(load_config(args.config, [*mode_overrides(mode, args, run_dir), *extra]))


def slots_fraction(plan: Plan, slots: int, gpu_bytes: int) -> str:
    """The rollout.gpu_memory_fraction override that gives the fast engine `slots` slots on a `gpu_bytes` card (its
    KV cache: slots x Plan.rollout.max_seq_len positions; half a slot more, so the engine's floor lands on it)."""
    slot = shape_bytes(plan)[2] * plan.rollout.max_seq_len
    return f"rollout.gpu_memory_fraction={(slots + 0.5) * slot / gpu_bytes:.6f}"


# ------------------------------------------------------------------------------------------ memory
GIB = 2 ** 30
MEM_FRAC = 0.92  # of the card's memory: the rest for the CUDA context, NCCL and allocator fragmentation
ACTIVATIONS_GIB = 6.0  # per packed 8,192 tokens of a micro-batch's update (the 7B 4-GPU update peaked at 24.1 GiB)


def engine_slots(plan: Plan, gpu_bytes: int) -> tuple[int, dict[str, float]]:
    """The most fast-engine slots (KV rows of plan.rollout.max_seq_len positions) a rollout GPU holds beside what
    else lives there, capped at the Plan's slots (plan.rollout.max_batch), and the estimate in GiB. Estimated from
    the shape (bf16 weights, gradients and Adam moments in model.dtype):

        rollout pool    weights + fused q/k/v and gate/up copies (engines/fast/fused.py), + the bus staging copy
        colocated       fused copies + the larger of the generate phase (unsharded weights + the rank's shard of
                        weights and gradients, the Adam moments offloaded) and the update (the rank's shard of
                        weights, gradients and both moments + activations); the KV cache stays through the update
    """
    p, fused, kv_per_pos = shape_bytes(plan)
    w = plan.world["actor"]
    if plan.rollout_colocated:
        acts = ACTIVATIONS_GIB * GIB * (plan.config.algorithm.micro_batch_tokens or 8192) / 8192
        other = fused + max(p + 2 * p / w, 4 * p / w + acts)
    else:  # trainer.async_weights=bus: one more copy of the weights, the staging the bus receives into
        other = p + fused + (p if plan.pipeline is not None and plan.pipeline.weights == "bus" else 0)
    slot = kv_per_pos * plan.rollout.max_seq_len
    fits = int((MEM_FRAC * gpu_bytes - other) // slot)
    est = {"gpu_gib": gpu_bytes / GIB, "weights_gib": p / GIB, "fused_copies_gib": fused / GIB,
           "other_gib": other / GIB, "kv_slot_gib": slot / GIB}
    return max(1, min(fits, plan.rollout.max_batch)), est


def shape_bytes(plan: Plan) -> tuple[int, int, int]:
    """(weight bytes, bytes of the fused projection copies, KV-cache bytes per position) of the random: shape, from
    its modules built on the meta device (no memory)."""
    import torch

    from fleetrl.models.shapes import random_model

    dtype = getattr(torch, plan.config.model.dtype)
    model = random_model(plan.config.model.path, dtype, device="meta")
    size = dtype.itemsize
    fusable = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    params = sum(t.numel() for t in model.parameters())
    fused = sum(t.numel() for n, t in model.named_parameters() if n.split(".")[-2] in fusable)
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return params * size, fused * size, c.num_hidden_layers * c.num_key_value_heads * head_dim * 2 * size


def gpu_info() -> tuple[str, int]:
    """(name, bytes) of this host's first GPU, as the rollout workers will see theirs; ("cpu", 0) without one."""
    import torch

    if not torch.cuda.is_available():
        return "cpu", 0
    props = torch.cuda.get_device_properties(0)
    return props.name, props.total_memory


# ------------------------------------------------------------------------------------------ runs
class ModeTimeout(BaseException):
    """--mode-timeout passed. A BaseException, like KeyboardInterrupt, so no `except Exception` in the trainer
    takes it for a step's failure; Ray's blocking gets check for signals, so it interrupts a wait too."""


def run_mode(mode: str, args: argparse.Namespace) -> dict:
    run_dir = Path(f"/tmp/fleetrl-async-bench-{mode}-{int(time.time())}")
    plan = mode_plan(mode, args, run_dir)
    device, gpu_bytes = gpu_info()
    estimated = gpu_bytes and not args.slots and plan.config.model.path.startswith("random:")
    slots, mem = engine_slots(plan, gpu_bytes) if estimated else (args.slots, {})  # 0: the Plan's slots
    if slots and slots < plan.rollout.max_batch and gpu_bytes:
        plan = mode_plan(mode, args, run_dir, slots_fraction(plan, slots, gpu_bytes))
    os.environ[ENV] = f"{args.mean_len},{args.max_len},{plan.config.trainer.seed}"
    print(f"{mode}: pools {dict(plan.world)}, {plan.samples_per_step} samples a step, engine slots "
          f"{slots or plan.rollout.max_batch} of {plan.rollout.max_batch}, memory estimate {mem}", flush=True)
    t0 = time.time()
    error = launch(plan, run_dir, args.mode_timeout)
    rows = measured_rows(run_dir, args.warmup)
    setup = {"bench": "async_e2e", "mode": mode, "shape": plan.config.model.path, "device": device,
             "prompts_per_step": plan.config.data.prompts_per_step, "samples_per_step": plan.samples_per_step,
             "max_len": args.max_len, "engine_slots": slots or None, "engine_slots_plan": plan.rollout.max_batch,
             "memory_estimate": mem, "tag": args.tag, "overrides": args.overrides, "run_dir": str(run_dir)}
    if not rows:
        return setup | {"error": error or "no measured step (raise --steps)", "wall_s": time.time() - t0}
    # A run stopped by --mode-timeout after a measured step still reports it (flagged with the error).
    return setup | summarize(plan, rows, time.time() - t0) | ({"error": error} if error else {})


def launch(plan: Plan, run_dir: Path, timeout_s: int) -> str | None:
    """Runs the plan on a local Ray cluster (the worker hook installed, `timeout_s` seconds at most: 0 = none); the
    failure as text, or None. A failing mode leaves the next one its turn, with its GPUs freed by ray.shutdown."""
    ray.init(address="local", include_dashboard=False, log_to_driver=False,
             runtime_env={"worker_process_setup_hook": "bench.async_e2e.worker_setup",
                          "env_vars": {"OMP_NUM_THREADS": "1", ENV: os.environ[ENV]}})

    fired: list[bool] = []

    def expire(signum: int, frame: object) -> None:
        fired.append(True)
        raise ModeTimeout

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(timeout_s)
    try:
        run_plan(plan, run_dir)
        return None
    except BaseException as e:  # noqa: BLE001 (reported in the JSON; the next mode still runs)
        if fired:  # raised inside Ray's Cython wait, it surfaces as a SystemError around ModeTimeout
            return f"stopped by --mode-timeout {timeout_s} s"
        if not isinstance(e, Exception):
            raise
        text = f"{type(e).__name__}: {e}"
        # a remote error's own line (its type and message) ends its traceback: keep the head and that tail
        return text if len(text) <= 3000 else f"{text[:1000]} ... {text[-2000:]}"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        ray.shutdown()


def measured_rows(run_dir: Path, warmup: int) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [r for r in rows if "train/time/step" in r][warmup:]


def summarize(plan: Plan, rows: list[dict], wall: float) -> dict:
    gpus = sum(pool.world_size for pool in plan.pools.values())
    step = sum(r["train/time/step"] for r in rows)
    tokens = sum(r["train/tokens_per_s"] * r["train/time/step"] for r in rows)
    t = lambda k: sum(r.get(f"train/time/{k}", 0.0) for r in rows)  # noqa: E731
    out = {"gpus": gpus, "pools": dict(plan.world), "steps": len(rows),
           "step_s": step / len(rows), "tokens_per_s_per_gpu": tokens / step / gpus,
           "response_length_mean": statistics.mean(r["train/response_length_mean"] for r in rows),
           "response_length_max": max(r.get("train/response_length_max", 0) for r in rows),
           "phases_s": {k: t(k) / len(rows) for k in ("generate", "rollout_wait", "score", "logprobs",
                                                      "update_actor", "sync")},
           "weight_sync_s": t("sync") / len(rows), "wall_s": wall}
    if plan.rollout_colocated:
        out["pool_idle_frac"] = {"main": 1 - (t("generate") + t("logprobs") + t("update_actor") + t("sync")) / step}
        return out
    rollout_idle = sum(r["train/async/rollout_idle_s"] for r in rows)
    out["pool_idle_frac"] = {"train": 1 - (t("logprobs") + t("update_actor") + t("sync")) / step,
                             "gen": rollout_idle / step / plan.world["rollout"]}
    return out | async_stats(rows, plan.pipeline.max_staleness)


def async_stats(rows: list[dict], max_staleness: int) -> dict:
    """Staleness histogram (samples per staleness 0..k over the measured steps) and importance-weight statistics
    (token-weighted means averaged over steps; the extremes over all of them)."""
    hist = {j: int(sum(r.get(f"train/async/staleness_count/{j}", 0) for r in rows)) for j in range(max_staleness + 1)}
    is_stats = {}
    for k in ("ratio_mean", "weight_mean", "clipped_frac", "masked_frac"):
        vals = [r[f"train/rollout_is/{k}"] for r in rows if f"train/rollout_is/{k}" in r]
        if vals:
            is_stats[k] = statistics.mean(vals)
    if any("train/rollout_is/ratio_max" in r for r in rows):
        is_stats["ratio_max"] = max(r.get("train/rollout_is/ratio_max", 1.0) for r in rows)
        is_stats["ratio_min"] = min(r.get("train/rollout_is/ratio_min", 1.0) for r in rows)
    return {"staleness_hist": hist, "staleness_mean": statistics.mean(r["train/async/staleness_mean"] for r in rows),
            "rollout_is": is_stats}


# ------------------------------------------------------------------------------------------ report
def result_path(out: Path, mode: str, args: argparse.Namespace) -> Path:
    return out / f"async_e2e_{mode}{args.tag}{'_smoke' if args.smoke else ''}.json"


def summary(results: dict[str, dict]) -> list[str]:
    """One line per mode (tokens/s/GPU, speedup over sync, idle, staleness, weight sync, IS weights) and NeMo-RL's
    figures for the same recipe shape."""
    sync = results.get("sync", {}).get("tokens_per_s_per_gpu")
    lines = []
    for mode, r in results.items():
        if "tokens_per_s_per_gpu" not in r:
            lines.append(f"{mode}: {r.get('error')}")
            continue
        speed = f", {r['tokens_per_s_per_gpu'] / sync:.2f}x sync" if sync and mode != "sync" else ""
        idle = ", ".join(f"{k} {v:.0%}" for k, v in r["pool_idle_frac"].items())
        extra = (f"; staleness {r['staleness_hist']}, IS {json.dumps(r['rollout_is'])}"
                 if "staleness_hist" in r else "")
        lines.append(f"{mode} {r['pools']}: {r['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU{speed}; {r['step_s']:.1f} "
                     f"s/step; idle {idle}; weight sync {r['weight_sync_s']:.2f} s{extra} ({r.get('device')})")
    lines.append("NeMo-RL v0.5 Llama-3.1-8B GRPO, 16x H100: " + ", ".join(
        f"{k} {v:,} tokens/s/GPU" for k, v in NEMO_RL_TOKENS_PER_S_PER_GPU.items()))
    return lines


def load_results(args: argparse.Namespace) -> dict[str, dict]:
    """The results of every mode of this GPU count found in --out (parts run in separate calls or processes)."""
    modes = ["sync", *(m for m, s in SPLITS.items() if sum(s) == args.gpus)]
    paths = {m: result_path(Path(args.out), m, args) for m in modes}
    return {m: json.loads(p.read_text()) for m, p in paths.items() if p.exists()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, choices=sorted(WORKLOADS), default=2)
    ap.add_argument("--modes", default=None, help="comma-separated (default: sync and the GPU count's best split)")
    ap.add_argument("--shape", default=None, help="random: shape (default: the GPU count's workload)")
    ap.add_argument("--steps", type=int, default=None, help="measured steps (default 8 on 2 GPUs, 2 on 4)")
    ap.add_argument("--warmup", type=int, default=None, help="steps left out first (default 2 on 2 GPUs, 1 on 4)")
    ap.add_argument("--config", default="bench/e2e_grpo.yaml")
    ap.add_argument("--mean-len", type=float, default=None)
    ap.add_argument("--max-len", type=int, default=None)
    ap.add_argument("--slots", type=int, default=0, help="fast-engine slots per rollout worker, GPU only (0: the "
                    "engine_slots estimate)")
    ap.add_argument("--mode-timeout", type=int, default=0,
                    help="seconds per mode (0: none); a mode stopped after a measured step still reports it")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, short responses: checks the script")
    ap.add_argument("--summary", action="store_true", help="only the summary of the JSON files in --out")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench"))
    ap.add_argument("--tag", default=None, help="suffix of the JSON file names (default: '' on 2 GPUs, _4gpu[_SHAPE])")
    ap.add_argument("overrides", nargs="*", help="config overrides applied to every mode (key=value)")
    args = ap.parse_args(argv)
    return fill_defaults(args, WORKLOADS[args.gpus])


def fill_defaults(args: argparse.Namespace, w: Workload) -> argparse.Namespace:
    short = args.gpus > 2  # an 8B step is ~1 min: 2 steps + warm-up fit a 10-minute call beside start-up and compile
    defaults = {"modes": w.modes, "shape": w.shape, "steps": 2 if short else 8, "warmup": 1 if short else 2,
                "mean_len": w.mean_len, "max_len": w.max_len, "tag": ""}
    if args.tag is None and args.gpus > 2:  # the 4-GPU files apart from the 2-GPU ones, another shape apart too
        args.tag = f"_{args.gpus}gpu" + ("" if args.shape in (None, w.shape) else f"_{args.shape}")
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.smoke:
        args.steps, args.warmup, args.mean_len, args.max_len = 3, 1, 6.0, 16
    for mode in args.modes.split(","):
        split_of(mode, args.gpus)  # refuse an unknown mode before any run
    return args


def main() -> None:
    args = parse_args()
    if not args.summary:
        for mode in args.modes.split(","):  # one file per mode: gpu_suite.sh may run each in its own part
            result = run_mode(mode, args)
            path = result_path(Path(args.out), mode, args)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(result, indent=1))
            print("RESULT " + json.dumps(result), flush=True)
    print("\n".join(summary(load_results(args))))


if __name__ == "__main__":
    main()
