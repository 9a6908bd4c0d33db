"""Controller + Ray overhead per RL step on the CPU tiny config.

The same run (same seed, same data, same compute) once with workers as Ray actors and once in the driver
process (cluster.backend=local); the per-step difference is what Ray adds (serialisation, scheduling, object
transfer). Controller time outside worker calls is step time minus the timed phases.

    python bench/overhead.py [--steps 30] [--out bench/overhead.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

from fleetrl.config import derive_plan, load_config
from fleetrl.trainer.run import run_plan

PHASES = ("generate", "score", "logprobs", "values", "update_actor", "update_critic", "sync")


def measure(backend: str, steps: int, config: str) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"fleetrl-bench-{backend}-"))
    plan = derive_plan(load_config(config, [f"cluster.backend={backend}", f"trainer.total_steps={steps}",
                                            "trainer.val_every=0", "data.val=null", "tracking.console=false",
                                            "tracking.progress=false", "tracking.tensorboard=false",
                                            f"trainer.output_dir={out}"]))
    run_plan(plan, out)
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train/time/step" in r][3:]  # first steps warm up caches
    step = statistics.mean(r["train/time/step"] for r in rows)
    phases = {p: statistics.mean(r.get(f"train/time/{p}", 0.0) for r in rows) for p in PHASES}
    return {"step_s": step, "phases_s": phases, "outside_phases_s": step - sum(phases.values())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--config", default="examples/quickstart.yaml")
    ap.add_argument("--out", default="bench/overhead.json")
    args = ap.parse_args()
    local = measure("local", args.steps, args.config)
    ray_ = measure("ray", args.steps, args.config)
    result = {"config": args.config, "steps": args.steps, "date": time.strftime("%Y-%m-%d"),
              "machine": f"{platform.machine()} {platform.processor() or ''} cpus={__import__('os').cpu_count()}",
              "local": local, "ray": ray_, "ray_overhead_per_step_s": ray_["step_s"] - local["step_s"],
              "ray_overhead_fraction": (ray_["step_s"] - local["step_s"]) / ray_["step_s"]}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"{'backend':<8}{'step s':>10}{'outside phases s':>18}  " + " ".join(f"{p:>12}" for p in PHASES))
    for name in ("local", "ray"):
        r = result[name]
        print(f"{name:<8}{r['step_s']:>10.4f}{r['outside_phases_s']:>18.4f}  "
              + " ".join(f"{r['phases_s'][p]:>12.4f}" for p in PHASES))
    print(f"Ray overhead per step: {result['ray_overhead_per_step_s'] * 1000:.1f} ms "
          f"({100 * result['ray_overhead_fraction']:.1f}% of the step)")


if __name__ == "__main__":
    main()
