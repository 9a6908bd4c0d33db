"""CPU benchmark: GRPO steps of SmolLM2-135M-Instruct on offline arithmetic, through the library.

Runs `fleetrl.trainer.run.run_plan` on a SmolLM2 config (default examples/grpo_smollm2_arith.yaml: 8 prompts x 8
samples, <= 48 new tokens) with the options given, and reports seconds per step for each phase (mean over the
steps after the first, which pays one-off costs), the worker's CPU seconds per step over the same steps (on a
shared machine wall time also counts waiting for a core; CPU time measures the work), the 1-minute load average
during the run, and the peak resident memory of the process that hosts the worker (the driver itself with
--backend local, the largest Ray child process with --backend ray). Options left unset keep the config's value.

    PYTHONPATH=. python bench/cpu_smollm2.py --steps 3 --label arith_default
    PYTHONPATH=. python bench/cpu_smollm2.py --steps 3 --config examples/grpo_smollm2_lora.yaml --label lora
    PYTHONPATH=. python bench/cpu_smollm2.py --steps 4 --compare     # both configs above, one after the other
    PYTHONPATH=. python bench/cpu_smollm2.py --steps 60 --config examples/grpo_smollm2_lora.yaml --rss-curve \
        --onednn-cache 1024 --label rss_before --set rollout.max_new_tokens=32   # RSS per step; 1024: no bound

Writes bench/results/cpu_smollm2_<label>.json (--compare: also cpu_smollm2_compare.json) and prints markdown rows.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Self

import psutil

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {"before": ROOT / "examples" / "grpo_smollm2_arith.yaml", "after": ROOT / "examples" / "grpo_smollm2_lora.yaml"}
ARITH_OPTIONS = {"min_terms": 2, "max_terms": 2, "max_digits": 2, "allow_parentheses": False,
                 "allow_negation": False, "operators": ["+", "-"]}
PHASES = ("generate", "score", "logprobs", "update", "sync", "step")


class Sampler:
    """Samples, every `every` s, the RSS and CPU time (user + system) of this process and (with `children`) of each
    descendant (Ray workers descend from the raylet this driver started), and the 1-minute load average.
    `step_cpu` holds the worker's CPU time when each step's record appeared in `metrics`; `step_rss` the worker's
    RSS then and its peak since the previous step's record, in GiB (the RSS curve of a run)."""

    def __init__(self, children: bool, metrics: Path, every: float = 0.25) -> None:
        self.children, self.metrics, self.every = children, metrics, every
        self.rss: dict[int, int] = {}
        self.cpu: dict[int, float] = {}
        self.loads: list[float] = []
        self.step_cpu: list[float] = []
        self.step_rss: list[dict[str, float]] = []
        self._window_peak = 0
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
        now = 0
        while not self._stop.is_set():
            # Listing descendants scans /proc (costly at this rate): only when workers are other processes.
            for proc in [me, *(me.children(recursive=True) if self.children else [])]:
                try:
                    rss, cpu = proc.memory_info().rss, sum(proc.cpu_times()[:2])
                except psutil.Error:  # exited between listing and reading
                    continue
                self.rss[proc.pid] = max(self.rss.get(proc.pid, 0), rss)
                self.cpu[proc.pid] = cpu - (start if proc is me else 0.0)
                if proc.pid == self.worker_pid():
                    now, self._window_peak = rss, max(self._window_peak, rss)
            self.loads.append(os.getloadavg()[0])
            # Event lines (resumed, finished) share the file: count the step records only.
            lines = self.metrics.read_text().count('"train/time/step"') if self.metrics.is_file() else 0
            while len(self.step_cpu) < lines:
                self.step_cpu.append(self.cpu.get(self.worker_pid(), 0.0))
                self.step_rss.append({"step": len(self.step_cpu), "rss_gib": now / 2**30,
                                      "peak_gib": self._window_peak / 2**30})
                self._window_peak = now
            self._stop.wait(self.every)

    def worker_pid(self) -> int | None:
        me = os.getpid()
        if not self.children:
            return me
        return max((p for p in self.rss if p != me), key=self.rss.get, default=None)

    def peak_gib(self) -> float:
        return self.rss.get(self.worker_pid(), 0) / 2**30

    def cpu_per_step(self) -> float:
        """Worker CPU seconds per step after the first (whose line marks the start), else over the whole run."""
        marks = self.step_cpu
        return (marks[-1] - marks[0]) / (len(marks) - 1) if len(marks) > 1 else self.cpu.get(self.worker_pid(), 0.0)


def ensure_data(folder: Path) -> None:
    if not (folder / "train.parquet").is_file():
        from fleetrl.data.make import make_data

        make_data("basic_arithmetic", folder, n_train=2000, n_val=128, seed=0, options=ARITH_OPTIONS)


def overrides(args: argparse.Namespace, data: Path, out: Path) -> list[str]:
    items = [f"cluster.backend={args.backend}", f"data.train={data / 'train.parquet'}",
             f"data.val={data / 'val.parquet'}", f"trainer.total_steps={args.steps}", "trainer.val_before_train=false",
             "trainer.val_every=0", f"trainer.output_dir={out}", "trainer.save_every=0", "trainer.save_last=false",
             "tracking.tensorboard=false",
             "tracking.progress=false", f"cluster.pools.main.cpus_per_worker={args.threads}"]
    optional = {"model.dtype": args.dtype, "rollout.engine": args.engine, "algorithm.micro_batch_size": args.micro,
                "actor.autocast": args.autocast and repr(args.autocast),  # repr: YAML reads a bare off as False
                "rollout.compute_dtype": args.rollout_dtype,
                "actor.logprob_chunk": None if args.chunk is None else (args.chunk or "null")}
    items += [f"{k}={v}" for k, v in optional.items() if v is not None]
    if args.lora is not None:  # adapters on every linear layer but the head; alpha = 2 x rank (scale 2)
        items.append(f"actor.lora={{rank: {args.lora}, alpha: {2 * args.lora}}}" if args.lora else "actor.lora=null")
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


HEADER = ("| label | step s | generate | update | first step | worker CPU s/step | load avg (min-max) | peak RSS GiB "
          "| reward |\n|---|---|---|---|---|---|---|---|---|")


def row(rec: dict) -> str:
    s, load = rec["s_per_step"], rec["load_avg_1m"]
    return (f"| {rec['label']} | {s['step']:.1f} | {s['generate']:.1f} | {s['update']:.1f} | {s['first_step']:.1f} | "
            f"{rec['worker_cpu_s_per_step']:.1f} | {load['mean']:.1f} ({load['min']:.1f}-{load['max']:.1f}) | "
            f"{rec['peak_rss_gib']:.2f} | {s['reward_mean']:.3f} |")


def run_one(args: argparse.Namespace) -> dict:
    # The local backend's worker reads these in-process; Ray workers get them through cluster.env.
    if args.omp_wait != "default":
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait.upper()  # read when libgomp loads: before torch is imported
    if args.onednn_cache is not None:  # read at the first bf16 matmul; the worker's bound (64) keeps a set value
        from fleetrl.workers.memory import ONEDNN_CACHE_VARIABLES

        os.environ.update({k: str(args.onednn_cache) for k in ONEDNN_CACHE_VARIABLES})

    from fleetrl.config import derive_plan, load_config
    from fleetrl.trainer.run import run_plan

    data = Path(args.data)
    ensure_data(data)
    label = args.label or Path(args.config).stem
    with tempfile.TemporaryDirectory(prefix="cpu_smollm2_") as tmp:
        run_dir = Path(tmp) / "run"
        plan = derive_plan(load_config(args.config, overrides(args, data, run_dir)))
        t0 = time.perf_counter()
        with Sampler(children=args.backend == "ray", metrics=run_dir / "metrics.jsonl") as smp:
            run_plan(plan, run_dir)
        wall = time.perf_counter() - t0
        result = summarise(run_dir / "metrics.jsonl")
    loads = smp.loads or [os.getloadavg()[0]]
    return {"label": label, "config": str(args.config), "args": vars(args), "wall_s": wall, "s_per_step": result,
            "worker_cpu_s_per_step": smp.cpu_per_step(), "step_cpu_marks": smp.step_cpu,
            "load_avg_1m": {"min": min(loads), "mean": sum(loads) / len(loads), "max": max(loads)},
            "peak_rss_gib": smp.peak_gib(), "peak_rss_driver_gib": smp.rss.get(os.getpid(), 0) / 2**30,
            "rss_curve": smp.step_rss,
            "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def compare(args: argparse.Namespace, argv: list[str]) -> None:
    """Each config in its own process (peak RSS is per process), one after the other, same options."""
    records = {}
    for label, config in CONFIGS.items():
        cmd = [sys.executable, __file__, *argv, "--config", str(config), "--label", f"compare_{label}"]
        subprocess.run([c for c in cmd if c != "--compare"], check=True)
        records[label] = json.loads((Path(args.out) / f"cpu_smollm2_compare_{label}.json").read_text())
    b, a = records["before"], records["after"]
    summary = {"step_speedup": b["s_per_step"]["step"] / a["s_per_step"]["step"],
               "cpu_s_per_step_ratio": b["worker_cpu_s_per_step"] / a["worker_cpu_s_per_step"],
               "peak_rss_gib": {"before": b["peak_rss_gib"], "after": a["peak_rss_gib"]}}
    (Path(args.out) / "cpu_smollm2_compare.json").write_text(json.dumps({**records, "summary": summary}, indent=2))
    print(HEADER, row(b), row(a), sep="\n")
    print(f"step {summary['step_speedup']:.2f}x faster, worker CPU-s/step {summary['cpu_s_per_step_ratio']:.2f}x less")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(CONFIGS["before"]))
    ap.add_argument("--compare", action="store_true", help="run examples/grpo_smollm2_arith.yaml (before) then "
                    "examples/grpo_smollm2_lora.yaml (after), each in a fresh process")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--backend", default="local", choices=("local", "ray"))
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the worker (cpus_per_worker)")
    ap.add_argument("--engine", choices=("hf", "fast"))
    ap.add_argument("--dtype", choices=("float32", "bfloat16"))
    ap.add_argument("--micro", type=int, help="algorithm.micro_batch_size")
    ap.add_argument("--chunk", type=int, help="actor.logprob_chunk (0 = whole sequence)")
    ap.add_argument("--autocast", help="actor.autocast for the update (off | bfloat16)")
    ap.add_argument("--rollout-dtype", help="rollout.compute_dtype of the fast engine (e.g. bfloat16)")
    ap.add_argument("--lora", type=int, help="actor.lora rank, alpha 2 x rank (0 = full fine-tuning)")
    ap.add_argument("--data", default=str(ROOT / "data" / "arith"))
    ap.add_argument("--label", default=None)
    ap.add_argument("--set", nargs="*", default=[], help="extra config overrides key=value")
    ap.add_argument("--omp-wait", default="default", choices=("passive", "active", "default"),
                    help="OMP_WAIT_POLICY of the worker. default: unset, what `fleetrl train` gets (on an idle "
                         "2-core VM 1.5x faster than passive: 27 vs 40 s/step, bench/RESULTS.md); passive: OpenMP "
                         "threads sleep between ops, for a machine shared with other jobs, where threads that spin "
                         "while their sibling is descheduled make every op up to 100x slower")
    ap.add_argument("--rss-curve", action="store_true", help="print the worker's RSS after each step and its peak "
                    "during it (always kept in the JSON as rss_curve); growth over a run that a 3-step run misses")
    ap.add_argument("--onednn-cache", type=int, help="entries of oneDNN's and ideep's primitive caches (default: "
                    "the worker's bound, workers/memory.py; 1024 = the libraries' own default, the code before it)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    if args.compare:
        return compare(args, sys.argv[1:])
    record = run_one(args)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"cpu_smollm2_{record['label']}.json").write_text(json.dumps(record, indent=2))
    print(HEADER, row(record), sep="\n")
    if args.rss_curve:
        print("step: RSS after (peak during), GiB")
        print(" ".join(f"{r['step']}:{r['rss_gib']:.2f}({r['peak_gib']:.2f})" for r in record["rss_curve"]))


if __name__ == "__main__":
    main()
