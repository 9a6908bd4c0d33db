#!/usr/bin/env bash
# `fleetrl sweep` on a 2-GPU machine (issue 12): two quickstart runs in parallel, one GPU each. Each run's
# device.json records its CUDA_VISIBLE_DEVICES, nvidia-smi's UUID for it, and the UUID torch.cuda reports from
# inside the run's environment; the check at the end fails unless the two runs' GPUs are disjoint and the runs
# overlapped in time. Run from the repo root (on the device machine: same wheel setup as bench/gpu_suite.sh):
#   bash bench/sweep_gpu.sh            # writes $OUT/sweep (runs, sweep.json, report/) and $OUT/sweep_gpu.json
set -u
OUT=${OUT:-/tmp/fleetrl-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-}:$PWD PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0
nvidia-smi -L | tee "$OUT/gpus.txt"
rm -rf "$OUT/sweep"
# gpus_per_worker=1 puts the quickstart's one worker on a GPU, so each run needs (and gets) exactly one.
timeout 500 python3 -m fleetrl.cli.main sweep examples/quickstart.yaml --seeds 42,1337 --max-parallel 2 \
  --gpus-per-run 1 --out "$OUT/sweep" --plain trainer.total_steps=20 trainer.val_every=10 \
  cluster.pools.main.gpus_per_worker=1 2>&1 | tee "$OUT/sweep.log"
echo "sweep rc=${PIPESTATUS[0]}"
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
man = json.loads((out / "sweep" / "sweep.json").read_text())
rows = []
for r in man["runs"]:
    dev = json.loads((out / "sweep" / r["name"] / "device.json").read_text())
    rows.append({"run": r["name"], "state": r["state"], "started": r["started"], "ended": r["ended"], **dev})
    print(f"{r['name']:<12} {r['state']:<9} CUDA_VISIBLE_DEVICES={dev['cuda_visible_devices']} "
          f"torch={dev['torch_uuids']} nvidia-smi={dev['nvidia_smi_uuids']}")
torch_sets = [set(x["torch_uuids"]) if isinstance(x["torch_uuids"], list) else set() for x in rows]
checks = {
    "all finished": all(x["state"] == "finished" for x in rows),
    "one GPU each": all(len(s) == 1 for s in torch_sets),
    "disjoint": len(torch_sets) == 2 and not (torch_sets[0] & torch_sets[1]),
    # torch reports the UUID without nvidia-smi's "GPU-" prefix
    "torch sees the GPU nvidia-smi names": all({u.removeprefix("GPU-") for u in x["nvidia_smi_uuids"]} == s
                                               for x, s in zip(rows, torch_sets)),
    "ran in parallel": max(x["started"] for x in rows) < min(x["ended"] for x in rows),
}
for k, v in checks.items():
    print(f"{'PASS' if v else 'FAIL'}  {k}")
(out / "sweep_gpu.json").write_text(json.dumps({"runs": rows, "checks": checks}, indent=2))
sys.exit(0 if all(checks.values()) else 1)
PY
timeout 120 python3 -m fleetrl.cli.main report "$OUT/sweep" >"$OUT/report.log" 2>&1; echo "report rc=$?"
