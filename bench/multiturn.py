"""Multi-turn GRPO step through the real trainer: model and environment tokens/s, turns, engine idle time.

    PYTHONPATH=. python bench/multiturn.py [--engine fast|hf] [--steps 5] [--warmup 2] [--turns 4]
        [--turn-tokens 64] [--obs-words 64] [--latency-s 0] [--smoke] [--out DIR] [overrides ...]

Workload (bench/e2e_multiturn.yaml): e2e_grpo.yaml's model and batch, played as `--turns`-turn episodes against
`fixed_turns` (fleetrl/envs/throughput.py), a throughput environment: a random-init model never writes a tool
call, so every turn ends at its `--turn-tokens` cap and the environment answers `--obs-words` words, with
`--latency-s` of sleep standing in for a tool. Per rollout call (one per step, 1 GPU, local backend), read from
the episodes the rollout worker returns:
  model_tokens_per_s  model tokens sampled / wall time of the rollout call
  env_tokens_per_s    environment tokens appended (each is prefilled by the next turn) / the same wall time
  turns_per_episode   mean model turns per episode
  engine_idle_s       seconds the engine had nothing to do because it waited for environment replies (resets,
                      steps, observation tokenisation): the longest episode's env_wait_s, since turns are
                      synchronous and an episode active at turn k was active at every earlier turn
  slot_wait_s         mean env_wait_s per episode (how long an engine slot waited on replies, its batch's
                      slowest reply included)
--smoke: the same path on CPU in seconds (tiny: model, 4 prompts × 2, 3 turns of 4 tokens; either engine).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fleetrl.config import derive_plan, load_config  # noqa: E402
from fleetrl.trainer.run import run_plan  # noqa: E402
from fleetrl.workers import rollout  # noqa: E402

PHASES = ("generate", "score", "logprobs", "update_actor", "sync")
SMOKE = ["model.path=tiny:", "model.dtype=float32", "data.train=synthetic:lorem?n=64&words=8", "data.prompts_per_step=4", "rollout.n=2",
         "data.max_prompt_length=64", "rollout.env.max_total_tokens=96", "cluster.pools.main.gpus_per_worker=0",
         "algorithm.micro_batch_size=8"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", default="fast")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=64)
    ap.add_argument("--obs-words", type=int, default=64)
    ap.add_argument("--latency-s", type=float, default=0.0)
    ap.add_argument("--config", default="bench/e2e_multiturn.yaml")
    ap.add_argument("--smoke", action="store_true", help="tiny: model on CPU (checks the path, measures nothing)")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench"))
    ap.add_argument("--tag", default="")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.smoke:
        args.turns, args.turn_tokens, args.obs_words = 3, 4, 8
        args.steps, args.warmup = min(args.steps, 3), min(args.warmup, 1)
    run_dir = Path(f"/tmp/fleetrl-multiturn-{args.engine}-{int(time.time())}")
    overrides = [f"rollout.engine={args.engine}", f"trainer.total_steps={args.steps}", "tracking.console=false",
                 "trainer.save_last=false",  # a benchmark is never resumed: no checkpoint of its last step
                 f"rollout.max_new_tokens={args.turn_tokens}", f"rollout.env.max_turns={args.turns}",
                 f"rollout.env.kwargs.turns={args.turns}", f"rollout.env.kwargs.observation_words={args.obs_words}",
                 f"rollout.env.kwargs.latency_s={args.latency_s}", *(SMOKE if args.smoke else []),
                 *args.overrides, f"trainer.output_dir={run_dir}"]
    plan = derive_plan(load_config(args.config, overrides))
    calls: list[dict] = []
    install(calls)
    t0 = time.time()
    run_plan(plan, run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train/time/step" in r][args.warmup:]
    result = summarize(rows, calls[-len(rows):], plan, args, overrides, t0)
    out = Path(args.out) / f"e2e_multiturn_1gpu_{args.engine}{'_smoke' if args.smoke else ''}{args.tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"multi-turn GRPO, engine={args.engine}, {result['turns_per_episode']:.2f} turns/episode: "
          f"{result['step_s']:.2f} s/step, model {result['model_tokens_per_s']:.0f} tokens/s, environment "
          f"{result['env_tokens_per_s']:.0f} tokens/s, engine idle {result['engine_idle_s']:.3f} s/step "
          f"({100 * result['idle_share']:.1f}% of the rollout)")
    print("RESULT " + json.dumps(result))


def install(calls: list[dict]) -> None:
    """Wraps the in-process rollout component's generate: appends each call's wall time and episode counters."""
    original = rollout.RolloutComponent.generate

    def generate(self, batch, req):  # noqa: ANN001, ANN202
        start = time.perf_counter()
        out = original(self, batch, req)
        wall = time.perf_counter() - start
        if "env_turns" not in out:
            raise SystemExit("bench/multiturn.py needs rollout.env (the config has none)")
        calls.append({"wall_s": wall, "episodes": len(batch), "model_tokens": float(out["env_model_tokens"].sum()),
                      "env_tokens": float(out["env_env_tokens"].sum()), "turns": float(out["env_turns"].mean()),
                      "engine_idle_s": float(out["env_env_wait_s"].max()),
                      "slot_wait_s": float(out["env_env_wait_s"].mean())})
        return out

    rollout.RolloutComponent.generate = generate


def summarize(rows: list[dict], calls: list[dict], plan, args, overrides: list[str], t0: float) -> dict:  # noqa: ANN001
    import torch

    mean = lambda key: statistics.mean(c[key] for c in calls)  # noqa: E731
    wall = mean("wall_s")
    env = plan.config.rollout.env
    return {
        "bench": "e2e_multiturn", "gpus": 1, "engine": args.engine, "smoke": args.smoke,
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "workload": {"model": plan.config.model.path, "prompts_per_step": plan.config.data.prompts_per_step,
                     "n": plan.config.rollout.n, "turns": env.max_turns, "turn_tokens": args.turn_tokens,
                     "observation_words": args.obs_words, "latency_s": args.latency_s,
                     "max_total_tokens": env.max_total_tokens},
        "step_s": statistics.mean(r["train/time/step"] for r in rows),
        "phases_s": {p: statistics.mean(r.get(f"train/time/{p}", 0.0) for r in rows) for p in PHASES},
        "rollout_s": wall, "turns_per_episode": mean("turns"),
        "model_tokens_per_step": mean("model_tokens"), "env_tokens_per_step": mean("env_tokens"),
        "model_tokens_per_s": mean("model_tokens") / wall, "env_tokens_per_s": mean("env_tokens") / wall,
        "engine_idle_s": mean("engine_idle_s"), "idle_share": mean("engine_idle_s") / wall,
        "slot_wait_s": mean("slot_wait_s"),
        "rollout_logprob_diff_mean": statistics.mean(r.get("train/rollout_logprob_diff_mean", 0.0) for r in rows),
        "wall_s": time.time() - t0, "overrides": overrides, "tag": args.tag,
    }


if __name__ == "__main__":
    main()
