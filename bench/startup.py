"""Start-up time of a training pool: from process launch to the end of the first update, phase by phase.

Each of `--world` processes (torch.multiprocessing spawn, no Ray) is one worker of the run's pool, built by the
real code path: `Worker.init_dist`, then `Worker.build` (load or draw the model, the actor's training engine with
its FSDP2 sharding, the draw of each rank's shard, the colocated rollout engine), then two log-prob passes and two
updates on a synthetic batch (the first of each compiles, with actor.compile). Prints one JSON object, also written
to `--out` (else $OUT, else bench_out/): per phase the slowest rank's seconds (ranks wait for each other at every
collective) and each rank's; `ready_s`, launch to the end of the build on every rank (ready for step 1);
`first_update_done_s`; `imported_s`, launch to the imports done (interpreter, torch, the worker modules).

    python bench/startup.py --model random:qwen2.5-7b --world 4 --sharding fsdp2   # GPU host: NCCL, one GPU a rank
    python bench/startup.py --model tiny: --world 2 --sharding fsdp2               # CPU: gloo
    python bench/startup.py --compare-build random:qwen2.5-0.5b                    # host draw, before and now

On a GPU host the config gets actor.compile=true and, for a random: shape, model.dtype=bfloat16; `--set key=value`
adds or overrides config keys (e.g. --set actor.forward=native --set rollout.engine=fast). Run from the repository
root.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # fleetrl from this checkout, installed or not

POOL = "main"


def _overrides(args: argparse.Namespace, gpu: bool) -> list[str]:
    pool = f"cluster.pools.{POOL}"
    out = [f"model.path={args.model}", f"actor.sharding={args.sharding}", f"{pool}.workers_per_node={args.world}",
           f"{pool}.gpus_per_worker={1 if gpu else 0}", "tracking.progress=false",
           f"data.prompts_per_step={4 * args.world}", "rollout.n=2", f"algorithm.micro_batch_size={args.rows}"]
    if gpu:  # the first log-prob pass and update then include compiling the decoder layers
        out.append("actor.compile=true")
        if args.model.startswith("random:"):
            out.append("model.dtype=bfloat16")
    return out + list(args.set)


def _batch(rows: int, vocab: int, prompt: int = 32, response: int = 16):
    """A synthetic update batch: random token ids, full masks, on-policy fields."""
    from fleetrl.batch import Batch

    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(4, min(vocab, 1000), (rows, n), generator=g)  # noqa: E731
    return Batch({"prompts": ids(prompt), "prompt_mask": torch.ones(rows, prompt, dtype=torch.long),
                  "responses": ids(response), "response_mask": torch.ones(rows, response, dtype=torch.long),
                  "advantages": torch.randn(rows, response, generator=g),
                  "rollout_logprobs": -torch.rand(rows, response, generator=g)})


def _rank(rank: int, args: argparse.Namespace, port: int, launched: float, out: str) -> None:
    gpu = args.device == "cuda"
    if gpu:  # before CUDA starts in this process, one GPU a rank, as Ray sets it for each actor
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        os.environ["CUDA_VISIBLE_DEVICES"] = visible.split(",")[rank] if visible else str(rank)
    from fleetrl.config import derive_plan, load_config
    from fleetrl.workers.context import WorkerContext
    from fleetrl.workers.messages import MiniBatchCounts, UpdateSpec
    from fleetrl.workers.worker import Worker

    def sync() -> None:
        if gpu:
            torch.cuda.synchronize()

    marks = {"imported": time.time() - launched}
    seconds: dict[str, float] = {}

    def timed(name: str, fn, *a):  # noqa: ANN001, ANN202
        t0 = time.perf_counter()
        result = fn(*a)
        sync()
        seconds[name] = time.perf_counter() - t0
        return result

    plan = derive_plan(load_config(args.config, _overrides(args, gpu)))
    worker = Worker(WorkerContext(plan=plan, pool=POOL, roles=plan.pools[POOL].roles, rank=rank,
                                  world_size=args.world))
    try:
        timed("init_dist", worker.init_dist, "127.0.0.1", port, 600.0)
        timed("build", worker.build)
        seconds.update({f"build/{k}": v for k, v in worker.startup_s.items()})
        marks["ready"] = time.time() - launched
        batch = _batch(args.rows, worker.actor.model.config.vocab_size)
        for i in (1, 2):
            timed(f"logprobs_{i}", worker.compute_logprobs, batch)
        tokens = float(batch["response_mask"].sum()) * args.world
        spec = UpdateSpec(minis=(MiniBatchCounts(num_tokens=tokens, num_seqs=float(args.rows * args.world),
                                                 norm_len=16.0),), kl_coef=0.0, old_logprobs="current")
        for i in (1, 2):
            timed(f"update_{i}", worker.update_actor, batch, spec)
            if i == 1:
                marks["first_update_done"] = time.time() - launched
        if gpu:
            seconds["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30
    finally:
        worker.shutdown()
    Path(out, f"{rank}.json").write_text(json.dumps({"seconds": seconds, "marks": marks}))


def run(args: argparse.Namespace) -> dict:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (NVLS needs fabric setup we do not assume)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        launched = time.time()
        mp.start_processes(_rank, args=(args, port, launched, out), nprocs=args.world, start_method="spawn")
        ranks = [json.loads(Path(out, f"{r}.json").read_text()) for r in range(args.world)]
    phases = list(ranks[0]["seconds"])
    return {
        "model": args.model, "world": args.world, "sharding": args.sharding, "device": args.device,
        "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
        "torch": torch.__version__, "config": args.config, "overrides": list(args.set),
        "ready_s": round(max(r["marks"]["ready"] for r in ranks), 2),
        "first_update_done_s": round(max(r["marks"]["first_update_done"] for r in ranks), 2),
        "imported_s": round(max(r["marks"]["imported"] for r in ranks), 2),
        "phases_max_s": {p: round(max(r["seconds"].get(p, 0.0) for r in ranks), 3) for p in phases},
        "per_rank_s": [{p: round(v, 3) for p, v in r["seconds"].items()} for r in ranks],
    }


def compare_build(spec: str, dtype: torch.dtype, threads: int, repeats: int) -> dict:
    """Host (CPU) build of a random: shape: eagerly as before meta initialisation (the model's own init under a
    seeded global generator, then a cast), against now (meta device, then one seeded draw on the host)."""
    from transformers import AutoModelForCausalLM

    from fleetrl.models import shapes

    torch.set_num_threads(threads)
    cfg = shapes.shape_config(spec.removeprefix(shapes.RANDOM_PREFIX))  # the random: model's own config

    def eager() -> torch.nn.Module:  # the code of shapes.random_model before this change
        default = torch.get_default_dtype()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            torch.set_default_dtype(dtype)
            try:
                model = AutoModelForCausalLM.from_config(cfg)
            finally:
                torch.set_default_dtype(default)
        return model.to(dtype)

    ways = {"eager_before_s": eager, "meta_then_draw_s": lambda: shapes.random_model(spec, dtype, device="cpu"),
            "meta_only_s": lambda: shapes.random_model(spec, dtype, device="meta")}
    times: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(repeats):  # interleaved, so a busy neighbour slows each way alike
        for name, build in ways.items():
            t0 = time.perf_counter()
            model = build()
            times[name].append(time.perf_counter() - t0)
            del model
    return {"model": spec, "dtype": str(dtype), "threads": threads, "device": "cpu",
            **{k: round(min(v), 2) for k, v in times.items()}, "all_s": {k: [round(x, 2) for x in v] for k, v in times.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny:", help="model.path")
    p.add_argument("--world", type=int, default=2, help="ranks (one GPU each on a GPU host)")
    p.add_argument("--sharding", default="fsdp2", choices=("none", "fsdp2"))
    p.add_argument("--config", default="examples/quickstart.yaml", help="the run config the overrides apply to")
    p.add_argument("--set", action="append", default=[], help="another config override key=value (repeatable)")
    p.add_argument("--rows", type=int, default=8, help="rows of the synthetic batch per rank")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--compare-build", metavar="RANDOM_SHAPE", help="time a host build of this random: shape instead")
    p.add_argument("--threads", type=int, default=1, help="--compare-build: torch threads (a worker's cpu share)")
    p.add_argument("--repeats", type=int, default=2, help="--compare-build: builds of each kind")
    p.add_argument("--out", default=os.environ.get("OUT") or "bench_out", help="directory of the JSON file")
    args = p.parse_args()
    if args.compare_build:
        result = compare_build(args.compare_build, torch.bfloat16, args.threads, args.repeats)
        name = f"startup_build_{args.compare_build.split(':')[-1]}_t{args.threads}"
    else:
        result = run(args)
        name = f"startup_{args.model.rstrip(':').replace(':', '_')}_w{args.world}_{args.sharding}"
    text = json.dumps(result, indent=1)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, f"{name}.json").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
