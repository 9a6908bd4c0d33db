"""Decode throughput: HF `generate` vs FastRolloutEngine, and the fraction of the memory roofline reached.

  PYTHONPATH=. python bench/decode.py --engines fast,hf --out $OUT        # full grid (GPU)
  PYTHONPATH=. python bench/decode.py --check-only --out $OUT              # GPU correctness checks only
  PYTHONPATH=. python bench/decode.py --longtail --group 8                 # continuous vs static batching
  PYTHONPATH=. python bench/decode.py --tp 1,2,4 --shapes qwen2.5-7b --batches 256 --new-tokens 256  # TP engine
  PYTHONPATH=. python bench/decode.py --tp 1,2 --device cpu --shapes tiny --dtype float32 \
      --batches 8 --new-tokens 16 --prompt-len 16                         # the same code path on CPU (gloo)

Workload: random-init Qwen2.5 shapes in bf16, B random 128-token prompts, exactly N new tokens (no EOS), plain
temperature-1 sampling (the RL setting). Throughput = B * N / wall time of the whole call (prefill included).

Roofline (decode steps only): step t (t = 1..N-1) must read every matmul weight once plus the KV cache of all B
sequences at length P + t, so bytes = (N - 1) * W + B * kv_bytes_per_token * sum_t (P + t). Roofline time =
bytes / measured copy bandwidth (read + write); fraction = roofline time / measured decode time, where decode
time = t(N new tokens) - t(1 new token). `compute_floor_s` is the matmul FLOPs over the measured bf16 matmul
rate: at batch 256 it is close to the memory floor, so 100% of the memory roofline is not reachable there.
"""
from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import longtail  # noqa: E402
from bench.common import (  # noqa: E402
    build_qwen2,
    copy_bandwidth,
    device_info,
    kv_bytes_per_token,
    matmul_params,
    matmul_tflops,
    out_dir,
    print_table,
    wall_time,
    write_json,
)
from bench.e2e import gpu_gaps, kernel_report  # noqa: E402
from fleetrl.engines.fast import FastRolloutEngine  # noqa: E402
from fleetrl.engines.protocol import SamplingParams  # noqa: E402


def roofline(model: torch.nn.Module, dtype: torch.dtype, batch: int, prompt: int, new: int,
             group: int = 1, tp: int = 1) -> tuple[float, float]:
    """(bytes, matmul FLOPs) of the N-1 decode steps of one call. group > 1 (GRPO's samples per prompt): a
    prompt's cached rows are read once per group, as the engine's decode reads them at the group's leader.
    tp > 1: one rank's share (engines/fast/tp.py): 1/tp of the layers' projections, of the KV cache and of the
    attention FLOPs, plus the replicated LM head (and norms) whole, as every rank computes the full logits."""
    sharded = tp_sharded_params(model)
    params = sharded / tp + matmul_params(model) - sharded
    weights = params * torch.finfo(dtype).bits // 8
    positions = sum(prompt + t for t in range(1, new))
    kv_positions = batch * sum(range(1, new)) + batch // group * prompt * (new - 1)
    nbytes = (new - 1) * weights + kv_bytes_per_token(model, dtype) // tp * kv_positions
    cfg = model.config
    attn = 4 * cfg.num_hidden_layers * cfg.hidden_size * batch * positions // tp  # q.k and p.v of the rank's heads
    return float(nbytes), float(2 * params * batch * (new - 1) + attn)


def tp_sharded_params(model: torch.nn.Module) -> int:
    """Parameters tp.py splits over the ranks: the decoder layers' projections and their column biases. The norms
    and the row-parallel (o, down) biases stay whole on every rank, as do the embedding and the LM head."""
    whole = ("norm", "o_proj.bias", "down_proj.bias")
    return sum(p.numel() for n, p in model.model.layers.named_parameters() if not any(w in n for w in whole))


def prompts_for(batch: int, prompt: int, vocab: int, device: str, group: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """batch // group random prompts, each repeated `group` times in a row (GRPO's samples of a prompt)."""
    g = torch.Generator().manual_seed(batch * 7 + prompt)
    ids = torch.randint(0, vocab, (batch // group, prompt), generator=g).repeat_interleave(group, 0).to(device)
    return ids, torch.ones_like(ids)


def run_fast(model, args, batch: int, new: int, eng: FastRolloutEngine) -> tuple[float, float]:
    ids, mask = prompts_for(batch, args.prompt_len, model.config.vocab_size, args.device, args.group)
    # Warm-up at the timed length: the KV cache is sized per call, so a shorter warm-up left its growth (and
    # the re-capture of the graphs that read it) inside the timed call (the first row of each shape, 2026-11-23).
    eng.generate(ids, mask, SamplingParams(max_new_tokens=new, temperature=1.0, seed=0))
    total = wall_time(lambda: eng.generate(ids, mask, SamplingParams(max_new_tokens=new, seed=1)), args.device,
                      args.repeats)
    first = wall_time(lambda: eng.generate(ids, mask, SamplingParams(max_new_tokens=1, seed=1)), args.device, 3)
    return total, first


def run_hf(model, args, batch: int, new: int) -> tuple[float, float]:
    ids, mask = prompts_for(batch, args.prompt_len, model.config.vocab_size, args.device, args.group)
    kw = dict(attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0)
    model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)
    total = wall_time(lambda: model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw), args.device)
    first = wall_time(lambda: model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw), args.device, 3)
    return total, first


def bench(args, ceilings: dict, save) -> list[dict]:
    rows = []
    dtype = getattr(torch, args.dtype)
    for shape in args.shapes.split(","):
        model = build_qwen2(shape, dtype, args.device)
        for engine in args.engines.split(","):
            eng = None
            if engine == "fast":
                eng = FastRolloutEngine(model, None, device=args.device, max_batch=max(args.batches),
                                        max_seq_len=args.prompt_len + max(args.new_tokens), kernels=args.kernels,
                                        fuse_projections={"auto": None, "on": True, "off": False}[args.fuse])
            for batch in args.batches:
                for new in args.new_tokens:
                    total, first = run_fast(model, args, batch, new, eng) if eng else run_hf(model, args, batch, new)
                    nbytes, flops = roofline(model, dtype, batch, args.prompt_len, new,
                                             args.group if engine == "fast" else 1)
                    decode_s = max(total - first, 1e-9)
                    row = dict(shape=shape, engine=engine, fuse=args.fuse, batch=batch, group=args.group,
                               new_tokens=new, seconds=total,
                               tokens_per_s=batch * new / total, decode_s=decode_s,
                               step_ms=1e3 * decode_s / (new - 1), roofline_s=nbytes / ceilings["copy_Bps"],
                               compute_floor_s=flops / (ceilings["matmul_tflops"] * 1e12),
                               achieved_GBps=nbytes / decode_s / 1e9)
                    row["roofline_frac"] = row["roofline_s"] / decode_s
                    rows.append(row)
                    save(rows)
                    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
            del eng
            gc.collect()
            torch.cuda.empty_cache() if args.device.startswith("cuda") else None
        del model
        gc.collect()
    return rows


# ---------------------------------------------------------------------------------------------- tensor parallel
# --tp 1,2,4: for each degree k, k spawned processes (one GPU each; gloo on CPU) run one TP engine together
# (engines/fast/tp.py), every rank with the same seeded model and prompts; rank 0 reports. Per-rank bytes: 1/k of
# the projections and of the KV cache, plus the replicated LM head (`roofline`); the all-reduce payload is
# 2 x layers x [B, hidden] per decode step (o and down), of which a ring moves 2(k-1)/k per rank each way.
TP_CHECK_ROWS, TP_CHECK_TOKENS = 16, 32
TP_MIN_FIRST_EQUAL = 0.5  # bf16 random models have near-tied logits: some flips are rounding, most are a bug
TP_TARGET = 0.8  # issue 37: TP 2's per-GPU tokens/s at batch 256 over TP 1's


def tp_grid(args: argparse.Namespace) -> tuple[dict, list[dict]]:
    """(device info, rows) of every shape x degree; a degree whose ranks fail gets an `error` row and the
    others still run."""
    info, rows = {}, []
    for shape in args.shapes.split(","):
        for k in args.tp:
            try:
                got = _spawn_degree(args, shape, k)
            except Exception as e:  # (a rank's traceback, a deadline, an OOM: recorded, not fatal)
                got = {"info": {}, "rows": [dict(shape=shape, tp=k, error=f"{type(e).__name__}: {e}"[-2000:])]}
            info = info or got["info"]
            rows += got["rows"]
            print(*got["rows"], sep="\n", flush=True)
    for r in rows:  # per-GPU throughput against TP 1's at the same shape, batch and length
        base = next((b for b in rows if b.get("tp") == 1 and "error" not in b and
                     (b["shape"], b["batch"], b["new_tokens"]) == (r["shape"], r.get("batch"), r.get("new_tokens"))),
                    None)
        if base is not None and "error" not in r:
            r["per_gpu_vs_tp1"] = r["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"]
    return info, rows


def _spawn_degree(args: argparse.Namespace, shape: str, k: int) -> dict:
    """k ranks joined by join=True: a rank that raises or passes its deadline ends the others (mp.spawn)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()  # rank 0's small result dict: well under a pipe's buffer, so put() never blocks
    mp.start_processes(_tp_rank, args=(k, _free_port(), args, shape, queue), nprocs=k, join=True,
                       start_method="spawn")
    return queue.get()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tp_rank(rank: int, k: int, port: int, args: argparse.Namespace, shape: str, queue: object) -> None:
    import faulthandler
    import os
    from datetime import timedelta

    import torch.distributed as dist

    # Collectives captured in CUDA graphs are not watched by NCCL's timeout (the watchdog skips captured work), so
    # a hang inside a replay would outlive init_process_group's timeout: this deadline ends the rank (exit 1, with
    # every thread's stack on stderr) and mp.spawn then ends the others.
    faulthandler.dump_traceback_later(args.tp_timeout, exit=True)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast on the lent hosts (as gpu_suite.sh sets)
    on_gpu = args.device.startswith("cuda")
    if on_gpu:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // k))  # k ranks share the host's cores
    dist.init_process_group("nccl" if on_gpu else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=k, timeout=timedelta(seconds=args.tp_timeout),
                            device_id=torch.device("cuda", rank) if on_gpu else None)
    rows = _tp_measure(args, shape, k, rank, f"cuda:{rank}" if on_gpu else "cpu")  # a raise exits 1 (deadline kept)
    if rank == 0:
        print(*rows, sep="\n", flush=True)  # in the log too, whatever happens to the queue
        queue.put({"info": device_info(args.device), "rows": rows})
    if on_gpu:
        # NCCL's destroy_process_group hung on both ranks after the engine's graphs had captured its all-reduces
        # (TP 2 on an H200 host, 2026-11-27: the deadline ended them and the measured rows were lost); ending the
        # process frees the communicators anyway.
        sys.stdout.flush()
        os._exit(0)
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()


def _tp_measure(args: argparse.Namespace, shape: str, k: int, rank: int, device: str) -> list[dict]:
    """Every rank runs the same calls (their collectives must match); rank 0's rows come back."""
    import torch.distributed as dist

    dtype = getattr(torch, args.dtype)
    on_gpu = device.startswith("cuda")
    # Measured before the model exists (2 x 2 GiB of copy buffers); the other ranks build meanwhile.
    ceilings = {"copy_Bps": copy_bandwidth(device) if on_gpu else 50e9,
                "matmul_tflops": matmul_tflops(device) if on_gpu else 1.0} if rank == 0 else {}
    model = build_qwen2(shape, dtype, device)  # seeded: the same weights on every rank, drawn on its own device
    check = _tp_greedy_check(model, args, device, k, rank)
    eng = FastRolloutEngine(model, None, device=device, max_batch=max(args.batches),
                            max_seq_len=args.prompt_len + max(*args.new_tokens, TP_CHECK_TOKENS),
                            kernels=args.kernels, fuse_projections={"auto": None, "on": True, "off": False}[args.fuse],
                            tp_group=dist.group.WORLD)
    check.update(_greedy_rows(eng, args, device, model.config.vocab_size, check.pop("reference", None)))
    rows = []
    for batch in args.batches:
        for new in args.new_tokens:
            times = torch.tensor(run_fast(model, args, batch, new, eng), device=device, dtype=torch.float64)
            dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank's wall time (they differ by little)
            if rank == 0:
                rows.append(_tp_row(model, args, shape, k, batch, new, times.tolist(), ceilings, check))
    return rows


def _tp_greedy_check(model: torch.nn.Module, args: argparse.Namespace, device: str, k: int, rank: int) -> dict:
    """Rank 0's reference: the greedy tokens of a one-rank engine on the same weights (TP 1). Built and freed
    before the TP engine, so its fused copies never sit beside the TP engine's; at k = 1 there is nothing to
    compare. The other ranks wait in the TP engine's first collective meanwhile."""
    if k == 1 or rank != 0:
        return {}
    ref = FastRolloutEngine(model, None, device=device, max_batch=TP_CHECK_ROWS,
                            max_seq_len=args.prompt_len + TP_CHECK_TOKENS, kernels=args.kernels,
                            fuse_projections={"auto": None, "on": True, "off": False}[args.fuse])
    ids, mask = prompts_for(TP_CHECK_ROWS, args.prompt_len, model.config.vocab_size, device)
    out = ref.generate(ids, mask, SamplingParams(max_new_tokens=TP_CHECK_TOKENS, temperature=0.0)).responses
    del ref
    gc.collect()
    torch.cuda.empty_cache() if device.startswith("cuda") else None
    return {"reference": out}


def _greedy_rows(eng: FastRolloutEngine, args: argparse.Namespace, device: str, vocab: int,
                 ref: torch.Tensor | None) -> dict:
    """The TP engine's greedy tokens (every rank calls) against rank 0's reference: rows equal over all
    TP_CHECK_TOKENS, rows whose first token is equal, and the first position where any row differs."""
    ids, mask = prompts_for(TP_CHECK_ROWS, args.prompt_len, vocab, device)
    got = eng.generate(ids, mask, SamplingParams(max_new_tokens=TP_CHECK_TOKENS, temperature=0.0)).responses
    if ref is None:
        return {}
    same = got.cpu() == ref.cpu()
    differ = (~same).any(0).nonzero()
    return dict(check_rows=TP_CHECK_ROWS, check_tokens=TP_CHECK_TOKENS, greedy_rows_equal=int(same.all(1).sum()),
                greedy_first_token_equal=int(same[:, 0].sum()),
                greedy_first_diff_at=int(differ[0]) if len(differ) else None)


def _tp_row(model: torch.nn.Module, args: argparse.Namespace, shape: str, k: int, batch: int, new: int,
            times: list[float], ceilings: dict, check: dict) -> dict:
    total, first = times
    dtype = getattr(torch, args.dtype)
    nbytes, flops = roofline(model, dtype, batch, args.prompt_len, new, tp=k)
    decode_s = max(total - first, 1e-9)
    cfg, size = model.config, torch.finfo(dtype).bits // 8
    reduced = 2 * cfg.num_hidden_layers * batch * cfg.hidden_size * size * (new - 1)  # o and down, every step
    row = dict(shape=shape, tp=k, batch=batch, new_tokens=new, seconds=total, tokens_per_s=batch * new / total,
               tokens_per_s_per_gpu=batch * new / total / k, decode_s=decode_s, step_ms=1e3 * decode_s / (new - 1),
               rank_bytes=nbytes, rank_roofline_s=nbytes / ceilings["copy_Bps"],
               rank_compute_floor_s=flops / (ceilings["matmul_tflops"] * 1e12),
               rank_achieved_GBps=nbytes / decode_s / 1e9, allreduce_payload_bytes=reduced if k > 1 else 0,
               allreduce_ring_bytes_per_rank=2 * (k - 1) / k * reduced, ceilings=ceilings, **check)
    row["rank_roofline_frac"] = row["rank_roofline_s"] / decode_s
    return row


def tp_failures(rows: list[dict]) -> list[str]:
    """What makes the run fail: a degree that did not finish, or first greedy tokens that differ broadly."""
    bad = [f"tp {r['tp']}: {r['error']}" for r in rows if "error" in r]
    for r in rows:
        if "greedy_first_token_equal" in r and r["greedy_first_token_equal"] < TP_MIN_FIRST_EQUAL * r["check_rows"]:
            bad.append(f"tp {r['tp']}: greedy first tokens equal TP 1's in {r['greedy_first_token_equal']} of "
                       f"{r['check_rows']} rows")
    return sorted(set(bad))


def longtail_batching(args) -> list[dict]:
    """Continuous against static batching on long-tailed response lengths (bench/longtail.py: mean ~300, max
    --max-len). `requests` prompts (groups of --group samples) through an engine of max_batch = the largest
    --batches. continuous: one call with each sample's drawn limit, so a finished slot takes the next waiting
    prompt and the tail decodes in a compacted batch. static: calls of max_batch samples, each decoding every row
    to its batch's longest drawn length (a batch ends with its longest response, as batch-at-a-time generate
    does). Both produce the same useful tokens: the drawn lengths' sum."""
    rows: list[dict] = []
    for shape in args.shapes.split(","):
        rows += _longtail_shape(args, shape, max(args.batches))
        gc.collect()
        torch.cuda.empty_cache() if args.device.startswith("cuda") else None
    return rows


def _longtail_shape(args, shape: str, batch: int) -> list[dict]:
    model = build_qwen2(shape, getattr(torch, args.dtype), args.device)
    eng = FastRolloutEngine(model, None, device=args.device, max_batch=batch,
                            max_seq_len=args.prompt_len + args.max_len, kernels=args.kernels)
    ids, mask = prompts_for(args.requests, args.prompt_len, model.config.vocab_size, args.device, args.group)
    lengths = longtail.draw_lengths(args.requests, mean=longtail.DEFAULT_MEAN, max_len=args.max_len, seed=0, step=0)
    chunks = [slice(i, i + batch) for i in range(0, args.requests, batch)]

    def continuous() -> None:
        eng.generate(ids, mask, SamplingParams(max_new_tokens=args.max_len, seed=1, max_new_tokens_per_sample=lengths))

    def static() -> None:
        for c in chunks:
            eng.generate(ids[c], mask[c], SamplingParams(max_new_tokens=int(lengths[c].max()), seed=1))

    useful, rows = int(lengths.sum()), []
    for mode, fn in (("continuous", continuous), ("static", static)):
        fn()  # warm-up: captures the graphs of every batch bucket the mode reaches
        seconds = wall_time(fn, args.device, args.repeats)
        decoded = useful if mode == "continuous" else sum(int(lengths[c].max()) * len(lengths[c]) for c in chunks)
        rows.append(dict(shape=shape, mode=mode, requests=args.requests, group=args.group, max_batch=batch,
                         mean_len=float(lengths.float().mean()), max_len=int(lengths.max()), seconds=seconds,
                         useful_tokens=useful, useful_tokens_per_s=useful / seconds, sample_tokens_decoded=decoded,
                         useful_frac=useful / decoded))
        print(rows[-1], flush=True)
    rows[0]["speedup_vs_static"] = rows[1]["seconds"] / rows[0]["seconds"]
    if args.profile:
        eng.stats = dict.fromkeys(eng.stats, 0)
        rows[0]["profile"] = phase_profile(continuous)
        rows[0]["engine_stats"] = dict(eng.stats)
        prof = rows[0]["profile"]
        print("\n".join(prof["kernels"][:16]), {k: v for k, v in prof.items() if k != "kernels"},
              rows[0]["engine_stats"], flush=True)
    return rows


def phase_profile(fn) -> dict:  # noqa: ANN001
    """One call of fn under the torch profiler: its host window, the GPU's busy time, and the GPU's idle time split
    by the engine phase (`engine.*` record_function ranges of engine.py) the host was in when each gap began."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize() if torch.cuda.is_available() else None
    t0, t1, gaps = gpu_gaps(prof)
    phases = [e for e in prof.events() if e.device_type.name == "CPU" and e.name.startswith("engine.")]
    out: dict = {"window_s": (t1 - t0) / 1e6, "busy_s": (t1 - t0 - sum(g for g, _ in gaps)) / 1e6}
    for g, at in gaps:
        phase = next((p.name for p in phases if p.time_range.start <= at < p.time_range.end), "outside")
        out[f"idle_s/{phase}"] = out.get(f"idle_s/{phase}", 0.0) + g / 1e6
    out["kernels"] = kernel_report(prof).splitlines()
    return out


def checks(args) -> dict:
    """Correctness on this device: exact vs HF in fp32 (both kernel sets), bf16 logprob gaps at a real shape."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    out: dict = {}
    kernel_sets = ("triton", "torch") if args.device.startswith("cuda") else ("torch",)
    small = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(3, 40, (12,), generator=g)
    width = int(lens.max())
    ids = torch.randint(1, 1000, (12, width), generator=g)
    mask = (torch.arange(width)[None] >= width - lens[:, None]).long()
    ids, mask = (ids * mask).to(args.device), mask.to(args.device)
    # Qwen3Config's default head_dim (128) is not hidden / heads (32) here: q_norm/k_norm over a wider head
    families = (("llama", LlamaForCausalLM, LlamaConfig), ("qwen2", Qwen2ForCausalLM, Qwen2Config),
                ("qwen3", Qwen3ForCausalLM, Qwen3Config), ("mistral", MistralForCausalLM, MistralConfig))
    for arch, cls, cfg_cls in families:
        torch.manual_seed(0)
        with torch.device(args.device):
            model = cls(cfg_cls(**small)).eval()
        model.generation_config.eos_token_id = None
        ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=48, pad_token_id=0)[:, width:]
        for kernels, fuse in ((k, f) for k in kernel_sets for f in (True, False)):
            for max_batch in (16, 4):
                eng = FastRolloutEngine(model, None, device=args.device, max_batch=max_batch, max_seq_len=128,
                                        kernels=kernels, sync_every=5, fuse_projections=fuse)
                got = eng.generate(ids, mask, SamplingParams(max_new_tokens=48, temperature=0.0))
                smp = eng.generate(ids, mask, SamplingParams(max_new_tokens=48, temperature=0.8, seed=2))
                lp_gap = _logprob_gap(model, ids, mask, smp, 0.8)
                out[f"fp32/{arch}/{kernels}/fused={fuse}/max_batch={max_batch}"] = dict(
                    greedy_rows_equal_hf=int((got.responses == ref).all(1).sum()), rows=len(ref),
                    sampled_logprob_max_abs_gap=lp_gap, graphs=len(eng._graphs or []))
                print(out, flush=True)
    if args.device.startswith("cuda"):
        out["triton_sampler"] = sampler_check(args.device)
        print(out["triton_sampler"], flush=True)
    dtype = torch.bfloat16
    model = build_qwen2(args.check_shape, dtype, args.device)
    ids, mask = prompts_for(32, 64, model.config.vocab_size, args.device)
    for kernels in kernel_sets:
        eng = FastRolloutEngine(model, None, device=args.device, max_batch=32, max_seq_len=256, kernels=kernels)
        smp = eng.generate(ids, mask, SamplingParams(max_new_tokens=64, temperature=1.0, seed=3))
        out[f"bf16/{args.check_shape}/{kernels}"] = dict(sampled_logprob_max_abs_gap=_logprob_gap(model, ids, mask,
                                                                                                    smp, 1.0),
                                                         sampled_logprob_mean_abs_gap=_logprob_gap(model, ids, mask,
                                                                                                   smp, 1.0, "mean"))
        print(out, flush=True)
    return out


def sampler_check(device: str, rows: int = 20000, temperature: float = 0.8) -> dict:
    """The Triton sampler's draws against softmax(logits / T): 5 likely tokens spread over 3 of the 4096-column
    blocks of a 10,000-token vocab, the rest at logit -40 (never drawn). Chi-square, 4 degrees of freedom: a
    correct sampler exceeds 18.47 with probability 0.001. Also the largest log-prob error."""
    from fleetrl.engines.fast.triton_kernels import TritonKernels

    hot = {3: 1.0, 4100: 0.2, 5000: -0.5, 8191: -1.5, 9999: 0.7}
    logits = torch.full((10000,), -40.0, device=device)
    for t, v in hot.items():
        logits[t] = v
    batch = logits[None].repeat(rows, 1).to(torch.bfloat16)
    req = torch.arange(rows, device=device)
    tok, lp = TritonKernels(torch.device(device)).sample(batch, torch.tensor([temperature], device=device),
                                                         torch.tensor([7], device=device), req, req * 0, greedy=False)
    ref = torch.log_softmax(batch.float() / temperature, -1)
    probs = ref[0].exp().double()
    counts = torch.bincount(tok, minlength=10000).double()
    ids = sorted(hot)
    chi2 = float(((counts[ids] - rows * probs[ids]) ** 2 / (rows * probs[ids])).sum())
    return dict(chi2=chi2, chi2_limit=18.47, passed=chi2 < 18.47 and int(counts[ids].sum()) == rows,
                others_drawn=rows - int(counts[ids].sum()),
                logprob_max_abs_err=float((lp - ref.gather(1, tok[:, None])[:, 0]).abs().max()))


# Kernel-name fragments -> the part of a decode step they belong to (first match wins; cuBLAS/CUTLASS names vary).
KERNEL_PARTS = (("attention", ("_decode_attn", "_decode_merge")), ("sampler", ("_sample_",)),
                ("rmsnorm", ("_add_rmsnorm",)), ("rope+cache", ("_rope_cache",)), ("silu*up", ("_silu_mul",)),
                ("step update", ("_step_update",)),
                ("gemm", ("gemm", "gemv", "cutlass", "sm90", "sm80", "xmma", "cublas", "ampere", "hopper", "splitk")))


def kernel_parts(prof) -> dict[str, list[float]]:
    """part (KERNEL_PARTS) -> [device microseconds, launches] over a torch profiler run."""
    totals: dict[str, list[float]] = {}
    for ev in prof.key_averages():
        us = getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0.0)
        if not us or not ev.count:
            continue
        name = ev.key.lower()
        part = next((p for p, keys in KERNEL_PARTS if any(k in name for k in keys)), "other")
        t = totals.setdefault(part, [0.0, 0])
        t[0] += us
        t[1] += ev.count
    return totals


def per_step(run: dict[str, list[float]], base: dict[str, list[float]], steps: int) -> list[str]:
    """(run - base) / steps per part: `base` is a 1-token call (prefill + first sample), so what remains is the
    decode steps alone."""
    rows = {p: [(v[0] - base.get(p, [0, 0])[0]) / steps, (v[1] - base.get(p, [0, 0])[1]) / steps]
            for p, v in run.items()}
    total = sum(us for us, _ in rows.values()) or 1e-9
    out = [f"  {p:12s} {us:8.1f} us/step ({us / total:5.1%})  {n:6.1f} launches/step"
           for p, (us, n) in sorted(rows.items(), key=lambda kv: -kv[1][0])]
    return out + [f"  {'total':12s} {total:8.1f} us/step of kernel time"]


def profile(args, out: Path) -> None:
    """Kernel-time breakdown of 32 decode steps at batch --profile-batch (fused projections on/off, graphs on/off),
    the LM head and the sampler timed alone, and the attention kernel's bandwidth alone, written to profile.txt."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from bench.common import event_time
    from fleetrl.engines.fast.arch import DecoderSpec
    from fleetrl.engines.fast.triton_kernels import TritonKernels

    lines = []
    model = build_qwen2(args.profile_shape, torch.bfloat16, args.device)
    nb = args.profile_batch
    ids, mask = prompts_for(nb, args.prompt_len, model.config.vocab_size, args.device)
    for graphs, fuse in ((True, True), (True, False), (False, True)):
        eng = FastRolloutEngine(model, None, device=args.device, max_batch=nb, max_seq_len=args.prompt_len + 64,
                                use_cuda_graphs=graphs, fuse_projections=fuse)
        eng.generate(ids, mask, SamplingParams(max_new_tokens=8, seed=0))
        parts = []
        for new in (1, 33):  # the 1-token call is the prefill alone, subtracted below
            with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                eng.generate(ids, mask, SamplingParams(max_new_tokens=new, seed=0))
            parts.append(kernel_parts(prof))
        lines += [f"== {args.profile_shape} batch {nb}, 32 decode steps (+ prefill), cuda graphs={graphs}, "
                  f"fused projections={fuse} ({_gib(eng._fwd.fused.nbytes()) if fuse else 0:.2f} GiB)",
                  "per decode step (the 33-token call minus the 1-token call, / 32):", *per_step(parts[1], parts[0], 32),
                  prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30)]
        del eng
    lines += head_and_sampler(model, args.device, nb)
    kn = TritonKernels(torch.device(args.device))
    for name, heads, kv, dim in (("0.5b", 14, 2, 64), ("1.5b", 12, 2, 128)):
        spec = DecoderSpec(num_layers=1, hidden=heads * dim, num_heads=heads, num_kv_heads=kv, head_dim=dim,
                           vocab=1, rms_eps=1e-6)
        kc = torch.randn(256, kv, 1152, dim, device=args.device, dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        q = torch.randn(256, heads * dim, device=args.device, dtype=torch.bfloat16)
        k, v = (torch.randn(256, kv * dim, device=args.device, dtype=torch.bfloat16) for _ in range(2))
        cos, sin = (torch.randn(1152, dim, device=args.device, dtype=torch.bfloat16) for _ in range(2))
        for length in (256, 640, 1152):
            pos = torch.full((256,), length - 1, device=args.device)
            own = torch.arange(256, device=args.device)  # every slot reads its own rows (no shared prompt)
            sec = event_time(lambda: kn.decode_attention(q, k, v, cos, sin, pos, kc, vc, spec, dim ** -0.5, own,
                                                         torch.zeros_like(own)), iters=20)
            gbps = 2 * kc[:, :, :length].numel() * 2 / sec / 1e9
            lines.append(f"attention {name} batch 256 len {length}: {sec * 1e6:.1f} us, {gbps:.0f} GB/s")
    (out / "profile.txt").write_text("\n".join(lines))
    print("\n".join(line for line in lines if not line.startswith(("-", " Name")) and "\n" not in line), flush=True)


def head_and_sampler(model, device: str, batch: int) -> list[str]:
    """The LM head GEMM and the Triton sampler alone at `batch` rows, against the bytes they must move."""
    import torch.nn.functional as F

    from bench.common import event_time
    from fleetrl.engines.fast.triton_kernels import TritonKernels

    w = model.lm_head.weight.detach()
    h = torch.randn(batch, w.shape[1], device=device, dtype=w.dtype)
    logits = F.linear(h, w)
    kn = TritonKernels(torch.device(device))
    req = torch.arange(batch, device=device)
    temp, seed = torch.ones(1, device=device), torch.zeros(1, dtype=torch.long, device=device)
    head_s = event_time(lambda: F.linear(h, w), iters=20)
    head_t_s = event_time(lambda: F.linear(w, h), iters=20)  # logits transposed [V, B]: another cuBLAS shape
    sample_s = event_time(lambda: kn.sample(logits, temp, seed, req, req, greedy=False), iters=20)
    greedy_s = event_time(lambda: kn.sample(logits, temp, seed, req, req, greedy=True), iters=20)
    head_bytes = w.numel() * w.element_size() + logits.numel() * logits.element_size()
    logit_bytes = logits.numel() * logits.element_size()
    return [f"lm head [{batch}, {w.shape[1]}] x [{w.shape[0]}, {w.shape[1]}]^T: {head_s * 1e6:.1f} us "
            f"({head_bytes / head_s / 1e9:.0f} GB/s of weight + logits); transposed product {head_t_s * 1e6:.1f} us",
            f"sampler batch {batch}: {sample_s * 1e6:.1f} us sampled, {greedy_s * 1e6:.1f} us greedy "
            f"({logit_bytes / sample_s / 1e9:.0f} GB/s of logits read)"]


def _gib(n: int) -> float:
    return n / 2 ** 30


def _logprob_gap(model, ids, mask, out, temperature: float, reduce: str = "max") -> float:
    full = torch.cat([ids, out.responses.to(ids.device)], 1)
    rmask = out.response_mask.to(ids.device)
    with torch.no_grad():
        logits = model(full, attention_mask=torch.cat([mask, rmask], 1)).logits.float()
    ref = torch.log_softmax(logits[:, ids.shape[1] - 1:-1] / temperature, -1)
    ref = ref.gather(2, full[:, ids.shape[1]:, None])[..., 0]
    gap = (ref - out.logprobs.to(ids.device)).abs()[rmask.bool()]
    return float(gap.max() if reduce == "max" else gap.mean())


def run_tp(args: argparse.Namespace, out: Path) -> None:
    """--tp: the grid, its JSON (info from rank 0: the parent never touches a GPU), the table; exit 1 on a failure."""
    info, rows = tp_grid(args)
    failures = tp_failures(rows)
    target = [dict(shape=r["shape"], batch=r["batch"], new_tokens=r["new_tokens"], per_gpu_vs_tp1=r["per_gpu_vs_tp1"],
                   met=r["per_gpu_vs_tp1"] >= TP_TARGET) for r in rows
              if r.get("tp") == 2 and r.get("batch") == 256 and "per_gpu_vs_tp1" in r]
    write_json(out / f"decode_tp{args.tag}.json", {"info": info, "rows": rows, "failures": failures,
                                                   f"target_tp2_per_gpu_ge_{TP_TARGET}": target})
    print("target", target, flush=True)
    print_table(rows, ["shape", "tp", "batch", "new_tokens", "tokens_per_s", "tokens_per_s_per_gpu", "per_gpu_vs_tp1",
                       "step_ms", "rank_roofline_frac", "rank_achieved_GBps", "greedy_rows_equal",
                       "greedy_first_token_equal"])
    if failures:
        sys.exit("decode --tp failed: " + "; ".join(failures))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="qwen2.5-0.5b,qwen2.5-1.5b")
    p.add_argument("--engines", default="fast,hf")
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[64, 256])
    p.add_argument("--new-tokens", type=lambda s: [int(x) for x in s.split(",")], default=[256, 1024])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--group", type=int, default=1, help="samples per prompt (GRPO's n): the fast engine reads a "
                   "prompt's cache rows once per group, and its roofline counts them so; HF's counts every row")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kernels", default="auto")
    p.add_argument("--fuse", default="auto", choices=("auto", "on", "off"),
                   help="fast engine's fused q/k/v and gate/up copies (auto = on for CUDA)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--check", action="store_true", help="run the correctness checks first")
    p.add_argument("--check-only", action="store_true")
    p.add_argument("--check-shape", default="qwen2.5-0.5b")
    p.add_argument("--profile", action="store_true", help="write profile.txt (kernel breakdown) and stop; with "
                   "--longtail: the GPU's idle time by engine phase in one continuous call")
    p.add_argument("--profile-shape", default="qwen2.5-0.5b")
    p.add_argument("--profile-batch", type=int, default=256, help="--profile: decode batch of the step breakdown, "
                   "the LM head and the sampler (the attention kernel alone stays at 256)")
    p.add_argument("--repeats", type=int, default=1, help="timed calls per row (the median is kept)")
    p.add_argument("--longtail", action="store_true", help="continuous vs static batching on long-tailed lengths")
    p.add_argument("--requests", type=int, default=1024, help="--longtail: samples in all")
    p.add_argument("--max-len", type=int, default=1024, help="--longtail: the most new tokens of a sample")
    p.add_argument("--tp", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="tensor-parallel degrees, e.g. 1,2,4: each runs the fast engine on that many ranks (one "
                   "GPU each, NCCL; gloo with --device cpu) and writes decode_tp<tag>.json")
    p.add_argument("--tp-timeout", type=float, default=300.0, help="--tp: seconds one degree's ranks may take, "
                   "start-up included (the collectives' timeout and each rank's own deadline)")
    p.add_argument("--tag", default="", help="suffix of the output file name")
    p.add_argument("--out", default=None, help="folder for decode_<engines>.json (default $OUT)")
    args = p.parse_args()
    out = out_dir(args.out)
    if args.tp:
        run_tp(args, out)
        return
    result: dict = {"info": device_info(args.device)}
    if args.profile and not args.longtail:
        profile(args, out)
        return
    if args.longtail:
        rows = longtail_batching(args)
        write_json(out / f"decode_longtail{args.tag}.json", {**result, "rows": rows})
        print_table(rows, ["shape", "mode", "requests", "seconds", "useful_tokens_per_s", "useful_frac"])
        return
    if args.check or args.check_only:
        result["checks"] = checks(args)
        write_json(out / f"decode_checks_{args.kernels}.json", result)
        if args.check_only:
            return
    on_gpu = args.device.startswith("cuda")
    result["ceilings"] = ceilings = {"copy_Bps": copy_bandwidth(args.device) if on_gpu else 50e9,
                                     "matmul_tflops": matmul_tflops(args.device) if on_gpu else 1.0}
    print("ceilings", ceilings, flush=True)
    path = out / f"decode_{args.engines.replace(',', '_')}{args.tag}.json"
    rows = bench(args, ceilings, lambda r: write_json(path, {**result, "rows": r}))  # saved row by row
    print_table(rows, ["shape", "engine", "batch", "new_tokens", "tokens_per_s", "step_ms", "roofline_frac",
                       "achieved_GBps", "compute_floor_s", "roofline_s", "decode_s"])


if __name__ == "__main__":
    main()
