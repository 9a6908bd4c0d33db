"""CPU benchmark: GRPO steps of SmolLM2-135M-Instruct on offline arithmetic, through the library.

Runs `fleetrl.trainer.run.run_plan` on examples/grpo_smollm2_arith.yaml (8 prompts x 8 samples, <= 48 new tokens),
with the engine / dtype / backend / threads given, and reports seconds per step for each phase (mean over the
steps after the first, which pays one-off costs) and the peak resident memory of the process that hosts the
worker (the driver itself with --backend local, the largest Ray child process with --backend ray).

    PYTHONPATH=. python bench/cpu_smollm2.py --steps 3 --engine fast --dtype float32 --label after
    PYTHONPATH=. python bench/cpu_smollm2.py --steps 3 --engine hf --backend ray --label before
    PYTHONPATH=. python bench/cpu_smollm2.py --steps 3 --engine fast --lora 16 --label lora16

Writes bench/results/cpu_smollm2_<label>.json and prints one markdown row.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import threading
import time
from pathlib import Path
from typing import Self

import psutil

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "grpo_smollm2_arith.yaml"
ARITH_OPTIONS = {"min_terms": 2, "max_terms": 2, "max_digits": 2, "allow_parentheses": False,
                 "allow_negation": False, "operators": ["+", "-"]}
PHASES = ("generate", "score", "logprobs", "update", "sync", "step")


class PeakRSS:
    """Samples the RSS of this process and of each descendant every `every` s (Ray workers are descendants of
    the raylet this driver started); `peak_self` and `peak_child` are the largest values seen, in bytes.
    `cpu_s` is the CPU time (user + system) of the process with the largest RSS (the worker): on a shared
    machine it measures the work done, where wall time also counts waiting for a core."""

    def __init__(self, children: bool, every: float = 0.25) -> None:
        self.children, self.every, self.peak_self, self.peak_child = children, every, 0, 0
        self._cpu: dict[int, float] = {}
        self._rss: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        me = psutil.Process()
        start = sum(me.cpu_times()[:2])
        while not self._stop.is_set():
            # Listing descendants scans /proc (costly at this rate): only when workers are other processes.
            for proc in [me, *(me.children(recursive=True) if self.children else [])]:
                try:
                    rss, cpu = proc.memory_info().rss, sum(proc.cpu_times()[:2])
                except psutil.Error:  # exited between listing and reading
                    continue
                self._rss[proc.pid] = max(self._rss.get(proc.pid, 0), rss)
                self._cpu[proc.pid] = cpu - (start if proc is me else 0.0)
            self.peak_self = self._rss[me.pid]
            self.peak_child = max([v for k, v in self._rss.items() if k != me.pid], default=0)
            self._stop.wait(self.every)

    def cpu_s(self, worker_is_self: bool) -> float:
        pid = psutil.Process().pid if worker_is_self else max(
            (p for p in self._rss if p != psutil.Process().pid), key=self._rss.get, default=None)
        return self._cpu.get(pid, 0.0)


def ensure_data(folder: Path) -> None:
    if not (folder / "train.parquet").is_file():
        from fleetrl.data.make import make_data

        make_data("basic_arithmetic", folder, n_train=2000, n_val=128, seed=0, options=ARITH_OPTIONS)


def overrides(args: argparse.Namespace, data: Path, out: Path) -> list[str]:
    # repr('off'): quoted, since YAML reads a bare off as False
    items = [f"model.dtype={args.dtype}", f"rollout.engine={args.engine}", f"cluster.backend={args.backend}",
             f"data.train={data / 'train.parquet'}", f"data.val={data / 'val.parquet'}",
             f"trainer.total_steps={args.steps}", "trainer.val_before_train=false", "trainer.val_every=0",
             f"trainer.output_dir={out}", "trainer.save_every=0", "tracking.tensorboard=false",
             "tracking.progress=false", f"algorithm.micro_batch_size={args.micro}",
             f"actor.logprob_chunk={args.chunk if args.chunk > 0 else 'null'}",
             f"cluster.pools.main.cpus_per_worker={args.threads}",
             f"actor.autocast={args.autocast or repr('off')}", f"rollout.compute_dtype={args.rollout_dtype or 'model'}"]
    if args.lora > 0:  # adapters on every linear layer but the head; alpha = 2 x rank (scale 2)
        items.append(f"actor.lora={{rank: {args.lora}, alpha: {2 * args.lora}}}")
    if args.omp_wait != "default":
        items.append(f"cluster.env.OMP_WAIT_POLICY={args.omp_wait.upper()}")
    return items + list(args.set)


def summarise(metrics_file: Path) -> dict[str, float]:
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "train/time/step" in r]
    timed = rows[1:] if len(rows) > 1 else rows  # step 1 pays one-off costs (allocations, lazy init)
    # Phase keys carry the role (update_actor, update_critic): a phase is the sum of its keys.
    out = {p: sum(v for r in timed for k, v in r.items() if k == f"train/time/{p}" or
                  k.startswith(f"train/time/{p}_")) / len(timed) for p in PHASES}
    out["first_step"] = rows[0]["train/time/step"]
    out["reward_mean"] = sum(r["train/reward_mean"] for r in rows) / len(rows)
    out["response_length_mean"] = sum(r["train/response_length_mean"] for r in rows) / len(rows)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--engine", default="fast", choices=("hf", "fast"))
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--backend", default="local", choices=("local", "ray"))
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the worker (cpus_per_worker)")
    ap.add_argument("--micro", type=int, default=16, help="algorithm.micro_batch_size")
    ap.add_argument("--chunk", type=int, default=16, help="actor.logprob_chunk (0 = whole sequence)")
    ap.add_argument("--data", default=str(ROOT / "data" / "arith"))
    ap.add_argument("--label", default=None)
    ap.add_argument("--set", nargs="*", default=[], help="extra config overrides key=value")
    ap.add_argument("--omp-wait", default="passive", choices=("passive", "active", "default"),
                    help="OMP_WAIT_POLICY of the worker: on a shared machine OpenMP threads that spin while "
                         "their sibling is descheduled make every op up to 100x slower (passive: they sleep)")
    ap.add_argument("--autocast", default="", help="actor.autocast for the update (e.g. bfloat16)")
    ap.add_argument("--rollout-dtype", default="", help="rollout.compute_dtype of the fast engine (e.g. bfloat16)")
    ap.add_argument("--lora", type=int, default=0, help="actor.lora rank (0 = full fine-tuning)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    # The local backend's worker reads these in-process; Ray workers get them through cluster.env.
    env = {}
    if args.omp_wait != "default":
        env["OMP_WAIT_POLICY"] = args.omp_wait.upper()  # read when libgomp loads: before torch is imported
    os.environ.update(env)

    from fleetrl.config import derive_plan, load_config
    from fleetrl.trainer.run import run_plan

    data = Path(args.data)
    ensure_data(data)
    label = args.label or f"{args.engine}_{args.dtype}_{args.backend}_t{args.threads}" + (
        f"_lora{args.lora}" if args.lora else "")
    with tempfile.TemporaryDirectory(prefix="cpu_smollm2_") as tmp:
        run_dir = Path(tmp) / "run"
        plan = derive_plan(load_config(str(CONFIG), overrides(args, data, run_dir)))
        t0 = time.perf_counter()
        with PeakRSS(children=args.backend == "ray") as rss:
            run_plan(plan, run_dir)
        wall = time.perf_counter() - t0
        result = summarise(run_dir / "metrics.jsonl")
    worker_rss = rss.peak_self if args.backend == "local" else rss.peak_child
    cpu = rss.cpu_s(worker_is_self=args.backend == "local")
    record = {"label": label, "args": vars(args), "wall_s": wall, "s_per_step": result,
              "worker_cpu_s_total": cpu, "load_avg_1m_end": os.getloadavg()[0], "peak_rss_gb": {
        "worker": worker_rss / 2**30, "driver": rss.peak_self / 2**30, "largest_child": rss.peak_child / 2**30},
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
        "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"cpu_smollm2_{label}.json").write_text(json.dumps(record, indent=2))
    s = result
    print("| label | step s | generate | logprobs | update | first step | worker CPU s (run) | peak RSS GB | reward |")
    print(f"| {label} | {s['step']:.1f} | {s['generate']:.1f} | {s['logprobs']:.1f} | {s['update']:.1f} | "
          f"{s['first_step']:.1f} | {cpu:.0f} | {worker_rss / 2**30:.2f} | {s['reward_mean']:.3f} |")


if __name__ == "__main__":
    main()
