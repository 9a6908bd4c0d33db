"""The decode step's per-layer GEMMs, one at a time: cuBLAS against Inductor's autotuned Triton GEMMs.

  PYTHONPATH=. python bench/decode_gemm.py --out $OUT [--shapes qwen2.5-0.5b,qwen2.5-1.5b] [--rows 256,64]

Each op runs as a model would: one distinct weight per layer (L copies, more than the L2 cache holds), the L
calls captured in one CUDA graph and replayed, so the time per op includes the in-graph launch gap but no host
overhead. Reported: us per op, TFLOP/s, and GB/s of the weight bytes. `down+silu` is the down projection
including the SiLU·up kernel that feeds it. `inductor` is torch.compile(mode="max-autotune-no-cudagraphs") of
the same F.linear call: it benchmarks cuBLAS against its own Triton GEMM templates (tile sizes, split-K) for the
exact shape and keeps the fastest, so it answers whether any tile choice beats cuBLAS here.

`splitk{S}` cuts K into S slices and runs them as one cuBLAS strided-batched GEMM with fp32 outputs (S partial
products, no copy of the operands: the slices are strided views), then sums the partials (+ bias) into the bf16
output with one small Triton kernel. Its point: at decode batch sizes a GEMM with few output tiles and a long K
(the down projection) keeps only a few SMs busy; S slices give S times the programs. `splitk{S}-gemm` is the
batched GEMM alone, which is the whole cost where the consumer (attention, SiLU·up) could sum the partials as
it loads them.
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

SPLITS = (2, 4, 8)

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


def bench_op(shape: str, name: str, rows: int, impls: set[str]) -> list[dict]:
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
        got = fn(0).float()
        if got.dim() == 3:  # S partial products: the consumer would sum them and add the bias
            got = got.sum(0) + (bs[0].float() if bs[0] is not None else 0)
        err = (got - ref).abs().max().item() / ref.abs().max().item()
        t = graph_time([lambda i=i: fn(i) for i in range(layers)])
        rows_out.append(dict(shape=shape, op=name, rows=rows, N=n, K=k, impl=impl, us=round(t * 1e6, 2),
                             tflops=round(flops / t / 1e12, 1), weight_GBps=round(wbytes / t / 1e9),
                             rel_err=float(f"{err:.2e}")))

    record("cublas", cublas)
    if "inductor" in impls:
        lin = torch.compile(lambda a, w, b: F.linear(a, w, b), mode="max-autotune-no-cudagraphs", dynamic=False)
        record("inductor", lambda i: lin(kern.silu_mul(x[:, :k], x[:, k:]) if silu else x, ws[i], bs[i]))
    if "splitk" in impls:
        for splits in SPLITS:
            def partials(i: int, s: int = splits) -> torch.Tensor:
                inp = kern.silu_mul(x[:, :k], x[:, k:]) if silu else x
                return torch.bmm(inp.view(rows, s, k // s).transpose(0, 1), ws[i].view(n, s, k // s).permute(1, 2, 0),
                                 out_dtype=torch.float32)

            record(f"splitk{splits}", lambda i, f=partials: splitk_sum(f(i), bs[i]))
            record(f"splitk{splits}-gemm", partials)
    print(" ".join(f"{r['impl']} {r['us']}" for r in rows_out), f"<- {shape} {name} M={rows}", flush=True)
    return rows_out


def splitk_sum(parts: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """sum over S of parts [S, M, N] fp32 (+ bias [N]) -> bf16 [M, N], in one launch."""
    import triton

    s, m, n = parts.shape
    out = torch.empty(m, n, device=parts.device, dtype=torch.bfloat16)
    block = 1024
    _splitk_sum_kernel()[(triton.cdiv(m * n, block),)](parts, bias if bias is not None else parts, out, m * n, n,
                                                         S=s, HAS_BIAS=bias is not None, BLOCK=block)
    return out


def _splitk_sum_kernel():  # built on first use: triton is imported only on a GPU machine
    global _SPLITK_SUM
    if _SPLITK_SUM is None:
        import triton
        import triton.language as tl

        @triton.jit
        def kernel(p_ptr, b_ptr, y_ptr, n_elem, n_cols, S: tl.constexpr, HAS_BIAS: tl.constexpr,
                   BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n_elem
            acc = tl.load(p_ptr + offs, mask=mask, other=0.0)
            for i in tl.static_range(1, S):
                acc += tl.load(p_ptr + i * n_elem + offs, mask=mask, other=0.0)
            if HAS_BIAS:
                acc += tl.load(b_ptr + offs % n_cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)

        _SPLITK_SUM = kernel
    return _SPLITK_SUM


_SPLITK_SUM = None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", default="qwen2.5-0.5b,qwen2.5-1.5b")
    ap.add_argument("--rows", default="256")
    ap.add_argument("--impls", default="inductor,splitk", help="besides cublas: inductor, splitk")
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
                rows += bench_op(shape, name, m, set(args.impls.split(",")))
                write_json(out / "decode_gemm.json", {"device": device_info("cuda"), "rows": rows})
    print_table(rows,
                ["shape", "op", "rows", "impl", "us", "tflops", "weight_GBps", "rel_err"])


if __name__ == "__main__":
    main()
