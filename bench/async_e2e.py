"""Asynchronous vs synchronous GRPO on 2 GPUs (issue 15), through the real trainer and Ray workers:

    sync   one pool of 2 GPUs: actor world 2, rollout colocated (generate, then train, on both GPUs)
    async  a rollout pool of 1 GPU generating while an actor pool of 1 GPU trains, trainer.max_staleness=1,
           truncated IS (algorithm.rollout_correction.mode=tis)

Same model (Qwen2.5-0.5B shape, random init, bf16: bench/e2e_grpo.yaml), same step (64 prompts × 8 samples), the
long-tailed response lengths of bench/longtail.py (mean 300, max 1024), applied inside every Ray worker through
Ray's worker_process_setup_hook. Reported per mode: tokens/s/GPU = (prompt + response tokens) / wall time of the
measured steps / 2, and each pool's idle fraction of that time:

    sync   pool idle = 1 - (generate + logprobs + update_actor + sync) / step   (both GPUs run every phase)
    async  actor idle = 1 - (logprobs + update_actor + sync) / step; rollout idle = gaps between the rollout
           worker's generate calls (train/async/rollout_idle_s) / step

    PYTHONPATH=. python bench/async_e2e.py [--modes sync,async] [--steps 8] [--warmup 2] [--out DIR] [--tag _pk]
    PYTHONPATH=. python bench/async_e2e.py --smoke     # CPU, tiny model, 4 steps: checks the script end to end
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import longtail  # noqa: E402
from fleetrl.config import derive_plan, load_config  # noqa: E402
from fleetrl.trainer.run import run_plan  # noqa: E402

ENV = "FLEETRL_BENCH_LONGTAIL"  # "mean,max_len,seed" for the worker hook
GPU = {"sync": ["cluster.pools={main: {workers_per_node: 2, gpus_per_worker: 1, cpus_per_worker: 2}}",
                "cluster.roles={actor: main, rollout: main}"],
       "async": ["cluster.pools={train: {gpus_per_worker: 1, cpus_per_worker: 2}, "
                 "gen: {gpus_per_worker: 1, cpus_per_worker: 2}}", "cluster.roles={actor: train, rollout: gen}",
                 "trainer.mode=async", "trainer.max_staleness=1", "algorithm.rollout_correction.mode=tis"]}
CPU = {"sync": ["cluster.pools={main: {workers_per_node: 2, cpus_per_worker: 0.5}}",
                "cluster.roles={actor: main, rollout: main}"],
       "async": ["cluster.pools={train: {cpus_per_worker: 0.5}, gen: {cpus_per_worker: 0.5}}",
                 "cluster.roles={actor: train, rollout: gen}", "trainer.mode=async", "trainer.max_staleness=1",
                 "algorithm.rollout_correction.mode=tis"]}
SMOKE = ["model.path=tiny:", "model.dtype=float32", "rollout.engine=hf", "data.prompts_per_step=8", "rollout.n=4",
         "data.train=synthetic:copy?n=200", "rewards.sources={}", "algorithm.micro_batch_size=16",
         "data.max_prompt_length=32"]  # the copy task's own scorer; lorem prompts are long for the tiny model


def worker_setup() -> None:
    """Ray worker_process_setup_hook: the long-tailed stop rule in every worker process (bench/longtail.py)."""
    spec = os.environ.get(ENV)
    if spec:
        mean, max_len, seed = spec.split(",")
        longtail.install(mean=float(mean), max_len=int(max_len), seed=int(seed), stats=[])


def run_mode(mode: str, args: argparse.Namespace) -> dict:
    overrides = [f"trainer.total_steps={args.warmup + args.steps}", "data.prompts_per_step=64",
                 f"rollout.max_new_tokens={args.max_len}", "cluster.backend=ray", "tracking.console=false",
                 "trainer.save_last=false",  # a benchmark is never resumed: no checkpoint of its last step
                 *(CPU if args.smoke else GPU)[mode], *(SMOKE if args.smoke else []), *args.overrides]
    run_dir = Path(f"/tmp/fleetrl-async-bench-{mode}-{int(time.time())}")
    overrides.append(f"trainer.output_dir={run_dir}")
    plan = derive_plan(load_config(args.config, overrides))
    os.environ[ENV] = f"{args.mean_len},{args.max_len},{plan.config.trainer.seed}"
    ray.init(address="local", include_dashboard=False, log_to_driver=False,
             runtime_env={"worker_process_setup_hook": "bench.async_e2e.worker_setup",
                          "env_vars": {"OMP_NUM_THREADS": "1", ENV: os.environ[ENV]}})
    t0 = time.time()
    try:
        run_plan(plan, run_dir)
    finally:
        ray.shutdown()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train/time/step" in r][args.warmup:]
    return summarize(mode, rows, time.time() - t0) | {"tag": args.tag, "overrides": args.overrides}


def summarize(mode: str, rows: list[dict], wall: float) -> dict:
    step = sum(r["train/time/step"] for r in rows)
    tokens = sum(r["train/tokens_per_s"] * r["train/time/step"] for r in rows)
    t = lambda k: sum(r.get(f"train/time/{k}", 0.0) for r in rows)  # noqa: E731
    out = {"bench": "async_e2e", "mode": mode, "gpus": 2, "steps": len(rows), "step_s": step / len(rows),
           "tokens_per_s_per_gpu": tokens / step / 2,
           "response_length_mean": statistics.mean(r["train/response_length_mean"] for r in rows),
           "phases_s": {k: t(k) / len(rows) for k in ("generate", "rollout_wait", "score", "logprobs",
                                                      "update_actor", "sync")}, "wall_s": wall}
    if mode == "sync":
        out["pool_idle_frac"] = {"main": 1 - (t("generate") + t("logprobs") + t("update_actor") + t("sync")) / step}
    else:
        rollout_idle = sum(r["train/async/rollout_idle_s"] for r in rows)
        out["pool_idle_frac"] = {"train": 1 - (t("logprobs") + t("update_actor") + t("sync")) / step,
                                 "gen": rollout_idle / step}
        out["staleness_mean"] = statistics.mean(r["train/async/staleness_mean"] for r in rows)
        out["rollout_is_ratio_max"] = max(r.get("train/rollout_is/ratio_max", 1.0) for r in rows)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="sync,async")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--config", default="bench/e2e_grpo.yaml")
    ap.add_argument("--mean-len", type=float, default=335.0)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, short responses: checks the script")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench"))
    ap.add_argument("--tag", default="", help="suffix of the JSON file names (a variant, e.g. _packed)")
    ap.add_argument("overrides", nargs="*", help="config overrides applied to both modes (key=value)")
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.warmup, args.mean_len, args.max_len = 3, 1, 6.0, 16
    results = {}
    for mode in args.modes.split(","):  # one file per mode: each mode fits one 10-minute device call
        results[mode] = run_mode(mode, args)
        path = Path(args.out) / f"async_e2e_{mode}{args.tag}{'_smoke' if args.smoke else ''}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results[mode], indent=1))
        print("RESULT " + json.dumps(results[mode]))
    if {"sync", "async"} <= set(results):
        print(f"async / sync tokens/s/GPU: "
              f"{results['async']['tokens_per_s_per_gpu'] / results['sync']['tokens_per_s_per_gpu']:.2f}x")


if __name__ == "__main__":
    main()
