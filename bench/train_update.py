"""Training-update throughput and MFU: forward + backward + fused AdamW step of random-init Qwen2.5 shapes.

  PYTHONPATH=. python bench/train_update.py --out $OUT
  PYTHONPATH=. python bench/train_update.py --native --shapes qwen2.5-0.5b --configs 8x2048 --out $OUT
      (eager HF, HF decoder layers compiled, our own forward compiled: actor.forward=native, models/decoder.py)

Precision: fp32 parameters (the master weights, updated by AdamW in fp32) with bf16 autocast for the forward and
backward matmuls; HF's own causal-LM loss (logits upcast to fp32); SDPA attention with no padding mask, so the
flash kernel runs; no activation checkpointing.

FLOPs per step: (6 N + 12 L H Q T) * tokens, with N the matmul parameters (tied vocab matrix once), L layers,
H heads, Q head dim, T sequence length; the attention term is PaLM's (Chowdhery et al. 2022, appendix B), which
counts the full (non-causal) score matrix. MFU = FLOPs / step time / dense bf16 peak (989.4 TFLOP/s for H100
SXM and H200, see bench/common.py); `of_matmul` is the same over the bf16 matmul rate measured here.
"""
from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import (  # noqa: E402
    build_qwen2,
    device_info,
    event_time,
    matmul_params,
    matmul_tflops,
    out_dir,
    peak_bf16_tflops,
    print_table,
    write_json,
)


def step_flops(model: torch.nn.Module, batch: int, seq: int) -> float:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_token = 6 * matmul_params(model) + 12 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * seq
    return float(per_token * batch * seq)


def run(shape: str, batch: int, seq: int, args, mode: str) -> dict:
    """mode: eager (HF modelling code) | compiled (each HF decoder layer compiled) | native (our own decoder
    forward, models/decoder.py, each layer compiled with fullgraph and static shapes)."""
    model = build_qwen2(shape, torch.float32, args.device).train()
    model.config.use_cache = False
    if mode == "compiled":  # regional compilation: one compiled decoder layer reused by all of them
        for layer in model.model.layers:
            layer.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=args.device.startswith("cuda"))
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=args.device)
    loss_fn = native_loss(model, ids, args.device) if mode == "native" else lambda: model(input_ids=ids, labels=ids).loss

    def update() -> None:
        with torch.autocast(args.device.split(":")[0], dtype=torch.bfloat16):
            loss = loss_fn()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        seconds = event_time(update, iters=args.steps, warmup=args.warmup)
        peak_mem = torch.cuda.max_memory_allocated() / 2**30
    else:
        import time
        update()
        t0 = time.perf_counter()
        update()
        seconds, peak_mem = time.perf_counter() - t0, 0.0
    flops = step_flops(model, batch, seq)
    model = opt = None  # free the memory before the next shape (update() is not called again)
    gc.collect()
    return dict(shape=shape, micro_batch=batch, seq=seq, mode=mode, tokens=batch * seq, step_s=seconds,
                tokens_per_s=batch * seq / seconds, tflops=flops / seconds / 1e12, peak_mem_gib=peak_mem)


def native_loss(model: torch.nn.Module, ids: torch.Tensor, device: str):  # noqa: ANN201
    """HF's causal-LM loss (next-token cross-entropy over fp32 logits) through our own forward."""
    from fleetrl.models.decoder import NativeDecoder

    decoder = NativeDecoder(model, compile_backend="inductor" if device.startswith("cuda") else None)
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)

    def loss() -> torch.Tensor:
        logits = model.lm_head(decoder.hidden(model, ids, positions))
        return F.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten())

    return loss


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="qwen2.5-0.5b,qwen2.5-1.5b")
    p.add_argument("--configs", default="4x2048,8x2048", help="micro-batch x sequence length, comma separated")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cuda")
    p.add_argument("--compile-layers", action="store_true", help="torch.compile each decoder layer (fuses the "
                   "RMSNorm/RoPE/SwiGLU elementwise ops; attention stays SDPA flash)")
    p.add_argument("--native", action="store_true", help="compare eager HF, compiled HF layers and our own compiled "
                   "forward (actor.forward=native) on each shape")
    p.add_argument("--tag", default="")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    info = device_info(args.device)
    on_gpu = args.device.startswith("cuda")
    peak = peak_bf16_tflops(info.get("device_name", "")) or float("nan")
    measured = matmul_tflops(args.device) if on_gpu else float("nan")
    rows = []
    modes = ["eager", "compiled", "native"] if args.native else ["compiled" if args.compile_layers else "eager"]
    for shape, cfg, mode in ((s, c, m) for s in args.shapes.split(",") for c in args.configs.split(",") for m in modes):
        batch, seq = (int(x) for x in cfg.split("x"))
        try:
            row = run(shape, batch, seq, args, mode)
        except torch.OutOfMemoryError as err:
            row = dict(shape=shape, micro_batch=batch, seq=seq, mode=mode, error=f"OOM: {str(err)[:120]}")
        if on_gpu:
            torch.cuda.empty_cache()
        if "tflops" in row:
            row.update(mfu=row["tflops"] / peak, of_matmul=row["tflops"] / measured)
        rows.append(row)
        print(row, flush=True)
        write_json(out_dir(args.out) / f"train_update{args.tag}.json", dict(  # saved row by row
            info=info, peak_bf16_dense_tflops=peak, measured_matmul_tflops=measured,
            precision="fp32 master params + bf16 autocast, fused AdamW", rows=rows))
    print(f"peak {peak} TFLOP/s (datasheet, dense bf16); measured 8192^3 bf16 matmul {measured:.0f} TFLOP/s")
    print_table(rows, ["shape", "micro_batch", "seq", "mode", "tokens_per_s", "step_s", "tflops", "mfu", "of_matmul",
                       "peak_mem_gib"])


if __name__ == "__main__":
    main()
