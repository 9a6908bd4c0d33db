"""The decode step's per-layer GEMMs, one at a time: cuBLAS against Inductor's autotuned Triton GEMMs.

  PYTHONPATH=. python bench/decode_gemm.py --out $OUT [--shapes qwen2.5-0.5b,qwen2.5-1.5b] [--rows 256,64]

Each op runs as a model would: one distinct weight per layer (L copies, more than the L2 cache holds), the L
calls captured in one CUDA graph and replayed, so the time per op includes the in-graph launch gap but no host
overhead. Reported: us per op, TFLOP/s, and GB/s of the weight bytes. `down+silu` is the down projection
including the SiLU·up kernel that feeds it. `inductor` is torch.compile(mode="max-autotune-no-cudagraphs") of
the same F.linear call: it benchmarks cuBLAS against its own Triton GEMM templates (tile sizes, split-K) for the
exact shape and keeps the fastest, so it answers whether any tile choice beats cuBLAS here.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import device_info, out_dir, print_table, write_json  # noqa: E402

SHAPES = {  # hidden, q heads, kv heads, head dim, intermediate, layers
    "qwen2.5-0.5b": (896, 14, 2, 64, 4864, 24),
    "qwen2.5-1.5b": (1536, 12, 2, 128, 8960, 28),
}


def ops(shape: str) -> dict[str, tuple[int, int, bool, bool]]:
    """name -> (N, K, bias, silu)."""
    hidden, h, kvh, d, inter, _ = SHAPES[shape]
    return {"qkv": (h * d + 2 * kvh * d, hidden, True, False), "o": (hidden, h * d, False, False),
            "gate_up": (2 * inter, hidden, False, False), "down+silu": (hidden, inter, False, True)}


def graph_time(calls: list[Callable[[], object]], replays: int = 20) -> float:
    """Seconds per call, the calls captured back to back in one CUDA graph."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / (replays * len(calls))


def bench_op(shape: str, name: str, rows: int) -> list[dict]:
    from fleetrl.engines.fast.triton_kernels import TritonKernels

    n, k, bias, silu = ops(shape)[name]
    layers, dev, dt = SHAPES[shape][-1], "cuda", torch.bfloat16
    ws = [torch.randn(n, k, device=dev, dtype=dt) / k ** 0.5 for _ in range(layers)]
    bs = [torch.randn(n, device=dev, dtype=dt) if bias else None for _ in range(layers)]
    x = torch.randn(rows, 2 * k if silu else k, device=dev, dtype=dt)
    kern = TritonKernels(torch.device(dev))
    flops, wbytes = 2 * rows * n * k, n * k * 2

    def cublas(i: int) -> torch.Tensor:
        inp = kern.silu_mul(x[:, :k], x[:, k:]) if silu else x
        return F.linear(inp, ws[i], bs[i])

    ref = cublas(0).float()
    rows_out = []

    def record(impl: str, fn: Callable[[int], torch.Tensor]) -> None:
        err = (fn(0).float() - ref).abs().max().item() / ref.abs().max().item()
        t = graph_time([lambda i=i: fn(i) for i in range(layers)])
        rows_out.append(dict(shape=shape, op=name, rows=rows, N=n, K=k, impl=impl, us=round(t * 1e6, 2),
                             tflops=round(flops / t / 1e12, 1), weight_GBps=round(wbytes / t / 1e9),
                             rel_err=float(f"{err:.2e}")))

    record("cublas", cublas)
    lin = torch.compile(lambda a, w, b: F.linear(a, w, b), mode="max-autotune-no-cudagraphs", dynamic=False)
    record("inductor", lambda i: lin(kern.silu_mul(x[:, :k], x[:, k:]) if silu else x, ws[i], bs[i]))
    print(f"{shape} {name} M={rows}: cublas {rows_out[0]['us']} us, inductor {rows_out[1]['us']} us", flush=True)
    return rows_out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", default="qwen2.5-0.5b,qwen2.5-1.5b")
    ap.add_argument("--rows", default="256")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    # one compiled F.linear per (shape, op, rows): past the default limit of 8 Dynamo would fall back to eager,
    # i.e. time cuBLAS under the inductor label
    torch._dynamo.config.recompile_limit = 64
    out = out_dir(args.out)
    rows = []
    for shape in args.shapes.split(","):
        for m in (int(r) for r in args.rows.split(",")):
            for name in ops(shape):
                rows += bench_op(shape, name, m)
                write_json(out / "decode_gemm.json", {"device": device_info("cuda"), "rows": rows})
    print_table(rows,
                ["shape", "op", "rows", "impl", "us", "tflops", "weight_GBps", "rel_err"])


if __name__ == "__main__":
    main()
