"""Controller + Ray overhead per RL step on the CPU tiny config.

Every worker call returns the seconds it spent computing inside the worker; the controller's wall time for
the call minus the slowest worker's compute is Ray's cost (serialisation, scheduling, object transfer),
summed per step as `train/time/worker_call_overhead`. The same run with cluster.backend=local (workers in the
driver) is the zero-Ray reference. Controller work = scoring + everything outside the timed phases.

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
                                            "trainer.save_last=false", f"trainer.output_dir={out}"]))
    run_plan(plan, out)
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train/time/step" in r][3:]  # first steps warm up caches
    step = statistics.mean(r["train/time/step"] for r in rows)
    phases = {p: statistics.mean(r.get(f"train/time/{p}", 0.0) for r in rows) for p in PHASES}
    overhead = statistics.mean(r["train/time/worker_call_overhead"] for r in rows)
    return {"step_s": step, "phases_s": phases, "outside_phases_s": step - sum(phases.values()),
            "worker_call_overhead_s": overhead, "controller_s": step - sum(phases.values()) + phases["score"]}


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
              "local": local, "ray": ray_}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"{'backend':<8}{'step s':>9}{'call overhead s':>17}{'controller s':>14}  "
          + " ".join(f"{p:>12}" for p in PHASES))
    for name in ("local", "ray"):
        r = result[name]
        print(f"{name:<8}{r['step_s']:>9.4f}{r['worker_call_overhead_s']:>17.4f}{r['controller_s']:>14.4f}  "
              + " ".join(f"{r['phases_s'][p]:>12.4f}" for p in PHASES))
    r = result["ray"]
    print(f"Ray call overhead: {1000 * r['worker_call_overhead_s']:.1f} ms/step "
          f"({100 * r['worker_call_overhead_s'] / r['step_s']:.1f}%); controller work (scoring, advantages, "
          f"bookkeeping): {1000 * r['controller_s']:.1f} ms/step")


if __name__ == "__main__":
    main()
