"""The decode's per-layer GEMMs at batch 256 (issue 14): cuBLAS against Inductor's max-autotune Triton templates.

Each GEMM of a Qwen2.5-0.5B / 1.5B decoder layer (fused q/k/v, o, fused gate/up, down; bf16, M = 256 rows) runs 20
times inside a CUDA graph, so the figure is device time with no launch gaps. Beside it: the time to move its
operands at the memory roofline (4.8 TB/s on an H200, 3.35 TB/s otherwise). One device call:

    python3 bench/decode_gemms.py        # writes $OUT/decode_gemms.json (default /tmp), a line per GEMM
"""
from __future__ import annotations

import json
import os
from typing import Callable

import torch
import torch._inductor.config as inductor_config

M = 256  # decode batch rows
SHAPES = {  # (K, N) of each GEMM of one layer, and the layer count
    "0.5B": (24, {"qkv": (896, 1152), "o": (896, 896), "gate_up": (896, 9728), "down": (4864, 896)}),
    "1.5B": (28, {"qkv": (1536, 2048), "o": (1536, 1536), "gate_up": (1536, 17920), "down": (8960, 1536)}),
}


def graph_us(fn: Callable[[], object], reps: int = 200, per_graph: int = 20) -> float:
    """Microseconds per call of fn, replayed from a CUDA graph of `per_graph` calls."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as graph capture requires
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps // per_graph):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (reps // per_graph * per_graph) * 1e3


def one_gemm(K: int, N: int, bandwidth: float) -> dict[str, float]:
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    cublas = graph_us(lambda: torch.mm(x, w.t(), out=out))
    tuned_fn = torch.compile(lambda a, b: a @ b.t(), mode="max-autotune-no-cudagraphs", dynamic=False)
    tuned_fn(x, w)
    tuned = graph_us(lambda: tuned_fn(x, w))
    moved = (K * N + M * K + M * N) * 2
    return {"cublas_us": round(cublas, 2), "autotuned_us": round(tuned, 2),
            "roofline_us": round(moved / bandwidth * 1e6, 2), "tflops_cublas": round(2 * M * K * N / cublas / 1e6, 1)}


def main() -> None:
    inductor_config.max_autotune_gemm_backends = "TRITON,ATEN"
    bandwidth = 4.8e12 if "H200" in torch.cuda.get_device_name() else 3.35e12
    results: dict[str, object] = {"device": torch.cuda.get_device_name(), "M": M}
    for model, (layers, mats) in SHAPES.items():
        rows = {name: one_gemm(K, N, bandwidth) for name, (K, N) in mats.items()}
        for name, row in rows.items():
            print(model, name, row, flush=True)
        results[model] = {"layers": layers, "gemms": rows,
                          "per_step_ms_cublas": round(sum(r["cublas_us"] for r in rows.values()) * layers / 1e3, 3),
                          "per_step_ms_roofline": round(sum(r["roofline_us"] for r in rows.values()) * layers / 1e3, 3)}
        print(model, "per step, all layers:", results[model]["per_step_ms_cublas"], "ms on cuBLAS;",
              results[model]["per_step_ms_roofline"], "ms at the roofline", flush=True)
    path = os.path.join(os.environ.get("OUT", "/tmp"), "decode_gemms.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
