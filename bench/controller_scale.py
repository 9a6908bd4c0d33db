"""The real controller against N simulated ranks: what the driver costs as the world grows, past one host.

Trainer.fit (trainer/trainer.py), the rank-local step (trainer/local.py) or the driver path, and the real
WorkerGroup calls under their watchdog (cluster/group.py, cluster/watchdog.py) run unchanged; only the ranks are
simulated: CPU Ray actors that answer each verb the controller calls with outputs of the right types, shapes and
sizes (RolloutReport / PrepareReport / UpdateMetrics of a rank's share; on the driver path Batches of a rank's
samples at full length), without models. The substitution is the group's actor factory (cluster/group.py
ActorFactory), passed through build_groups.

Why several ranks per process: a Ray worker process that imports torch (to unpickle a Batch) costs ~270 MB here,
so 128 one-rank processes need ~35 GB. `--ranks-per-process k` hosts k simulated ranks in one actor, each rank still
its own handle: the controller makes one Ray call per rank, the watchdog watches one ref per rank, exactly as with
one actor per rank. `--ranks-per-process 1` is that (one actor per rank; 8 fit easily, for the comparison).

Workload per rank (the e2e target shape, bench/e2e_grpo.yaml): 32 prompts x 8 samples x 256 response tokens.
Per step it reports: step seconds, the ranks' own seconds (the slowest rank's, per verb: ~0 by design),
controller seconds (the difference), Ray call overhead (`train/time/worker_call_overhead`), the driver process's
CPU seconds, bytes through the driver (`train/driver/bytes_out|in/<pool>`, cluster/telemetry.py) and its RSS.

    python bench/controller_scale.py [--n 8,32,128] [--paths local,driver] [--ranks-per-process 8] [--steps 4]

Each (N, path) runs in its own process (own Ray, own RSS); JSON to bench/results/controller_scale_<date>.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from fleetrl.batch import Batch
from fleetrl.workers.context import WorkerContext
from fleetrl.workers.messages import (
    Extreme,
    GenerateRequest,
    Moments,
    PrepareReport,
    PrepareRequest,
    RolloutReport,
    UpdateMetrics,
    UpdateSpec,
)

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "bench" / "e2e_grpo.yaml"
PROMPTS_PER_RANK = 32
VOCAB = 150_000  # response ids drawn below Qwen2.5's special tokens, so the driver path's decode is real work


# ------------------------------------------------------------------------------------------ the simulated rank
class SimRank:
    """One rank's answers to the controller's verbs, of the sizes a real rank would return; no model.

    The rank-local verbs keep what a real rank keeps between calls (how many samples it holds), so prepare and
    update report this rank's own token counts."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx, self.plan = ctx, ctx.plan
        self.length = ctx.plan.config.rollout.max_new_tokens  # every sample runs to the length limit (worst case)
        self.samples = 0
        self.version = 0
        self.cache: dict[tuple[str, int], dict[str, torch.Tensor]] = {}

    # -------------------------------------------------------------------- set-up
    def node_info(self) -> dict:
        import ray

        return {"hostname": os.uname().nodename, "ip": "127.0.0.1", "pid": os.getpid(), "rank": self.ctx.rank,
                "pool": self.ctx.pool, "roles": list(self.ctx.roles),
                "node_id": ray.get_runtime_context().get_node_id(), "cuda_visible_devices": None}

    def master_address(self) -> tuple[str, int]:
        return "127.0.0.1", 29500

    def init_dist(self, addr: str, port: int, timeout_s: float) -> None:
        """No process group: the simulated ranks run no collective."""

    def build(self) -> None:
        """No model."""

    def mark_weights_version(self, version: int) -> None:
        self.version = version

    def weights_version(self) -> int:
        return self.version

    def check_sync(self, version: int) -> float:
        """The policy check's gap (engines/sync_check.py): none without a model."""
        return 0.0

    def save_state(self, ckpt_dir: str) -> None:
        """Nothing to save (the bench runs with checkpoints off)."""

    def load_state(self, ckpt_dir: str) -> None:
        """Nothing to load."""

    def shutdown(self) -> None:
        self.cache = {}

    # -------------------------------------------------------------------- the rank-local step
    def rollout_local(self, prompts: Batch, req: GenerateRequest) -> RolloutReport:
        n, t = self.plan.config.rollout.n, self.length
        self.samples = len(prompts) * n
        b = float(self.samples)
        prompt_lens = prompts["prompt_mask"].sum(-1).double()
        reward = Moments(n=b, total=0.5 * b, squares=b / 3, high=0.999, low=0.0)
        moments = {"reward": reward, "response_length": Moments(n=b, total=b * t, squares=b * t * t, high=t, low=t),
                   "clipped": Moments(n=b, total=b, squares=b, high=1.0, low=1.0),
                   "prompt_length": Moments(n=b, total=n * float(prompt_lens.sum()),
                                            squares=n * float((prompt_lens ** 2).sum()),
                                            high=float(prompt_lens.max()), low=float(prompt_lens.min()))}
        for ds in sorted({str(s) for s in prompts["data_source"]}):
            moments[f"reward/{ds}"] = reward
        return RolloutReport(moments=moments, counters={"reward_errors": 0.0, "reward_timeouts": 0.0,
                                                        "reward_skipped": 0.0},
                             tokens=n * float(prompt_lens.sum()) + b * t,
                             timing={"generate/rollout": 0.0, "score": 0.0})

    def prepare_local(self, req: PrepareRequest) -> PrepareReport:
        from fleetrl.workers.phases import loss_mask_key

        plan, tokens = self.plan, float(self.samples * self.length)
        moments = {"advantage": Moments(n=tokens, total=0.0, squares=tokens, high=2.0, low=-2.0)}
        if plan.recompute_logprobs:
            moments["entropy"] = Moments(n=tokens, total=1.5 * tokens, squares=3 * tokens, high=5.0, low=0.0)
            moments["logprob_diff"] = Moments(n=tokens, total=0.01 * tokens, squares=1e-3 * tokens, high=0.5, low=0.0)
        minis = plan.num_mini_batches
        keys = sorted({plan.action_mask, loss_mask_key(plan, "actor")})
        return PrepareReport(moments=moments, kl=(0.001 * tokens, tokens) if plan.use_ref else None, correction={},
                             action_tokens=tokens, mini_tokens={k: (tokens / minis,) * minis for k in keys})

    def update_actor_local(self, spec: UpdateSpec) -> UpdateMetrics:
        return self._update("actor", float(self.samples * self.length), spec)

    def update_critic_local(self, spec: UpdateSpec) -> UpdateMetrics:
        return self._update("critic", float(self.samples * self.length), spec)

    # -------------------------------------------------------------------- the driver path
    def generate(self, batch: Batch, req: GenerateRequest) -> Batch:
        b = len(batch)
        out = self._tensors("generate", b, lambda g: {
            "responses": torch.randint(0, VOCAB, (b, self.length), generator=g),
            "response_mask": torch.ones(b, self.length, dtype=torch.long),
            "rollout_logprobs": -torch.rand(b, self.length, generator=g),
            "weights_version": torch.full((b,), self.version, dtype=torch.long)})
        return Batch(dict(out), {"finish_reason": ["length"] * b})

    def compute_logprobs(self, batch: Batch) -> Batch:
        return Batch(dict(self._floats("logprobs", len(batch), "old_logprobs", "entropy")))

    def compute_ref_logprobs(self, batch: Batch) -> Batch:
        return Batch(dict(self._floats("ref", len(batch), "ref_logprobs")))

    def compute_values(self, batch: Batch) -> Batch:
        return Batch(dict(self._floats("values", len(batch), "values")))

    def update_actor(self, batch: Batch, spec: UpdateSpec) -> UpdateMetrics:
        return self._update("actor", float(batch["response_mask"].sum()), spec)

    def update_critic(self, batch: Batch, spec: UpdateSpec) -> UpdateMetrics:
        return self._update("critic", float(batch["response_mask"].sum()), spec)

    # -------------------------------------------------------------------- helpers
    def _tensors(self, what: str, b: int, make: Any) -> dict[str, torch.Tensor]:
        """Made once per (verb, size): the call returns at once, so its own seconds stay ~0 (Ray still pickles
        the full tensors every call)."""
        if (what, b) not in self.cache:
            self.cache[(what, b)] = make(torch.Generator().manual_seed(self.ctx.rank))
        return self.cache[(what, b)]

    def _floats(self, what: str, b: int, *keys: str) -> dict[str, torch.Tensor]:
        return self._tensors(what, b, lambda g: {k: torch.rand(b, self.length, generator=g) for k in keys})

    def _update(self, role: str, tokens: float, spec: UpdateSpec) -> UpdateMetrics:
        """The keys and kinds a real update reports (workers/update.py, workers/actor.py): shares of global means,
        numbers equal on every rank, max/min extremes (the memory peak among them)."""
        world = float(self.ctx.world_size)
        loss = "pg_loss" if role == "actor" else "vf_loss"
        shares = {f"{role}/{loss}": 0.01 / world, f"{role}/clipfrac": 0.1 / world, f"{role}/approx_kl": 1e-3 / world,
                  f"{role}/tokens_real": tokens, f"{role}/tokens_slots": tokens}
        if role == "actor":
            shares |= {"entropy": 1.5 / world, "rollout_logprob_diff_mean": 0.01 / world}
        same = {f"{role}/grad_norm": 1.0, f"{role}/lr": 1e-6, f"{role}/skipped_updates": 0.0,
                f"{role}/allreduce_s": 0.0}
        extremes = {"memory/rss_gib": Extreme(_rss_mib() / 1024, "max")}
        if role == "actor":
            extremes["rollout_logprob_diff_max"] = Extreme(0.5, "max")
        return UpdateMetrics.of(shares, same, extremes)


class SimHost:
    """A Ray actor hosting simulated ranks `ranks` of one pool; `timed`/`progress` take the rank first."""

    def __init__(self, ctx: WorkerContext, ranks: list[int]) -> None:
        self.ranks = {r: SimRank(dataclasses.replace(ctx, rank=r)) for r in ranks}

    def timed(self, rank: int, method: str, *args: Any) -> tuple[Any, float]:
        t0 = time.perf_counter()
        out = getattr(self.ranks[rank], method)(*args)
        return out, time.perf_counter() - t0

    def progress(self, rank: int) -> int:
        return 0  # the calls return at once; the watchdog's pings only run while a call is pending


class _RankMethod:
    """`handle.<method>.remote(*args)` of one simulated rank: a Ray call on its host with the rank prepended."""

    def __init__(self, host: Any, rank: int, name: str, options: dict | None = None) -> None:
        self.host, self.rank, self.name, self.opts = host, rank, name, options or {}

    def options(self, **opts: Any) -> "_RankMethod":
        return _RankMethod(self.host, self.rank, self.name, opts)

    def remote(self, *args: Any) -> Any:
        method = getattr(self.host, self.name)
        return (method.options(**self.opts) if self.opts else method).remote(self.rank, *args)


@dataclasses.dataclass(frozen=True)
class RankHandle:
    """What the group holds for one simulated rank: answers `timed` and `progress` like the rank's actor handle."""
    host: Any
    rank: int

    @property
    def timed(self) -> _RankMethod:
        return _RankMethod(self.host, self.rank, "timed")

    @property
    def progress(self) -> _RankMethod:
        return _RankMethod(self.host, self.rank, "progress")


class SimulatedRanks:
    """cluster/group.py ActorFactory: `per_process` consecutive ranks in one SimHost actor, placed with the options
    the group chose (its placement group bundle, fractional CPU), one concurrency slot per rank and one for pings."""

    def __init__(self, per_process: int) -> None:
        self.per_process = per_process
        self.host: Any = None

    def __call__(self, ctx: WorkerContext, options: dict[str, Any]) -> RankHandle:
        import ray

        if ctx.rank % self.per_process == 0:  # group.py makes ranks in order: the first of each host makes it
            ranks = list(range(ctx.rank, min(ctx.rank + self.per_process, ctx.world_size)))
            self.host = ray.remote(SimHost).options(**{**options, "max_concurrency": len(ranks) + 1}).remote(ctx, ranks)
        return RankHandle(self.host, ctx.rank)


# ------------------------------------------------------------------------------------------ one run
def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run_one(n: int, rank_local: bool, per_process: int, steps: int, out_dir: Path,
            overrides: list[str] = ()) -> list[dict]:
    """Trainer.fit on `n` simulated ranks; the metrics.jsonl rows of its steps, with the driver's RSS and CPU."""
    import ray

    from fleetrl.cluster import build
    from fleetrl.cluster.runtime import ensure_ray
    from fleetrl.config import derive_plan, load_config, redacted_dict
    from fleetrl.tracking.tracker import Tracker
    from fleetrl.trainer.trainer import Trainer

    if __name__ != "__main__":  # imported (tests): workers cannot import bench/, so the classes travel by value
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    cfg = load_config(str(CONFIG), [
        "cluster.backend=ray", f"cluster.pools.main.workers_per_node={n}", "cluster.pools.main.gpus_per_worker=0",
        "cluster.pools.main.cpus_per_worker=0.01", "cluster.num_cpus=4", f"data.prompts_per_step={PROMPTS_PER_RANK * n}",
        f"trainer.rank_local={str(rank_local).lower()}", f"trainer.total_steps={steps}", "trainer.save_last=false",
        "trainer.save_every=0", "tracking.console=false", "tracking.progress=false", "tracking.tensorboard=false",
        f"trainer.output_dir={out_dir}", *overrides])
    plan = derive_plan(cfg)
    out_dir.mkdir(parents=True, exist_ok=True)

    class DriverTracker(Tracker):
        """Adds the driver process's RSS and CPU seconds since the previous step to each step's record."""
        cpu = _cpu_s()

        def log(self, step: int, metrics: dict[str, float]) -> None:
            cpu, DriverTracker.cpu = _cpu_s() - DriverTracker.cpu, _cpu_s()
            super().log(step, {**metrics, "bench/driver_rss_mib": _rss_mib(), "bench/driver_cpu_s": cpu})

    class SimulatedTrainer(Trainer):
        def build_groups(self) -> None:
            make = functools.partial(build.build_groups, make_actor=SimulatedRanks(per_process))
            with mock.patch.object(build, "build_groups", make):
                super().build_groups()

    started = ensure_ray(cfg.cluster)
    tracker = DriverTracker(out_dir, cfg.tracking, redacted_dict(cfg), cfg.trainer.name)
    trainer = SimulatedTrainer(plan, tracker, out_dir)
    try:
        t0 = time.perf_counter()
        trainer.build_groups()
        ready_s = time.perf_counter() - t0
        trainer.fit()
    finally:
        trainer.shutdown()
        tracker.close()
        if started:
            ray.shutdown()
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train/time/step" in r]
    for r in rows:
        r["bench/ready_s"] = ready_s
    return rows


def summarize(rows: list[dict], warmup: int) -> dict[str, float]:
    """Means over the steps after `warmup`; controller_s = step - the slowest rank's own seconds of each verb."""
    rows = rows[warmup:] or rows[-1:]
    mean = lambda key: statistics.mean(r.get(key, 0.0) for r in rows)  # noqa: E731
    rank_s = statistics.mean(sum(v for k, v in r.items() if k.startswith("train/time/rank/") and k.endswith("/max"))
                             for r in rows)
    out = {"step_s": mean("train/time/step"), "ranks_own_s": rank_s,
           "worker_call_overhead_s": mean("train/time/worker_call_overhead"),
           "driver_cpu_s": mean("bench/driver_cpu_s"), "bytes_out": mean("train/driver/bytes_out/main"),
           "bytes_in": mean("train/driver/bytes_in/main"), "driver_rss_mib": max(r["bench/driver_rss_mib"] for r in rows),
           "ready_s": rows[0]["bench/ready_s"], "steps": len(rows)}
    out["controller_s"] = out["step_s"] - rank_s
    skip = ("train/time/step", "train/time/worker_call_overhead")
    out["phases_s"] = {k[len("train/time/"):]: mean(k) for k in rows[0]
                       if k.count("/") == 2 and k.startswith("train/time/") and k not in skip}
    return out


# ------------------------------------------------------------------------------------------ the sweep
def _one_main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="fleetrl-cscale-") as tmp:
        rows = run_one(args.one, args.path == "local", args.ranks_per_process, args.steps, Path(tmp) / "run",
                       args.overrides)
    print("RESULT " + json.dumps({"n": args.one, "path": args.path, "ranks_per_process": args.ranks_per_process,
                                  **summarize(rows, args.warmup)}), flush=True)


def _table(results: list[dict]) -> str:
    head = ("| N | path | ranks/process | step s | ranks' own s | controller s | Ray call overhead s | driver CPU s "
            "| driver bytes out | driver bytes in | driver RSS MiB | ready s |\n|" + "---|" * 12)
    lines = [head]
    for r in results:
        lines.append(f"| {r['n']} | {r['path']} | {r['ranks_per_process']} | {r['step_s']:.3f} | {r['ranks_own_s']:.4f} "
                     f"| {r['controller_s']:.3f} | {r['worker_call_overhead_s']:.3f} | {r['driver_cpu_s']:.3f} "
                     f"| {r['bytes_out'] / 1e6:.2f} MB | {r['bytes_in'] / 1e6:.2f} MB | {r['driver_rss_mib']:.0f} "
                     f"| {r['ready_s']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", default="8,32,128", help="world sizes, comma-separated")
    ap.add_argument("--paths", default="local,driver", help="local (rank-local step), driver (trainer.rank_local=false)")
    ap.add_argument("--ranks-per-process", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1, help="first steps left out (each verb's first call)")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/controller_scale_<date>.json)")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # one (N, path) in this process
    ap.add_argument("--path", default="local", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. algorithm.advantage=gae")
    args = ap.parse_args()
    if args.one is not None:
        return _one_main(args)
    results = []
    for path in args.paths.split(","):
        for n in (int(x) for x in args.n.split(",")):
            cmd = [sys.executable, __file__, "--one", str(n), "--path", path, "--ranks-per-process",
                   str(args.ranks_per_process), "--steps", str(args.steps), "--warmup", str(args.warmup),
                   *args.overrides]
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"N={n} {path} failed:\n{proc.stderr[-4000:]}")
            results.append(json.loads(line[len("RESULT "):]))
            print(_table(results[-1:]).splitlines()[-1], flush=True)
    out = Path(args.out or ROOT / "bench" / "results" / f"controller_scale_{time.strftime('%Y-%m-%d')}.json")
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} cores, "
                               f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB",
                               "workload": f"{PROMPTS_PER_RANK} prompts x 8 samples x 256 tokens per rank "
                                           f"({CONFIG.relative_to(ROOT)})", "overrides": args.overrides,
                               "results": results}, indent=1))
    print(_table(results))
    print(f"JSON: {out}")


if __name__ == "__main__":
    main()
