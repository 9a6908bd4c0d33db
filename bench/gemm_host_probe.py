"""Host time of one bf16 GEMM call for a row count M seen before against a first-seen M (bench/RESULTS.md, eleventh
round).

A long-tailed update's varlen rows have a new length (a multiple of 128) in many micro-batches, and every GEMM of
the compiled layers takes that length as M. This probe queues ~100 ms of GPU sleep, so no launch waits for the
GPU, then times the host side of `torch.mm` at the 0.5B layer's widths: forward-like [M, 896] @ [896, N] and
weight-gradient-like [N, M] @ [M, 896], for M values repeated and for M values not seen before.

    PYTHONPATH=. python bench/gemm_host_probe.py [--out DIR]     (CUDA only)
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import device_info, out_dir, write_json  # noqa: E402

SLEEP_CYCLES = 200_000_000  # torch.cuda._sleep: ~100 ms at ~2 GHz, longer than the calls timed behind it
HIDDEN, WIDTHS = 896, (896, 1152, 4864, 9728)  # Qwen2.5-0.5B: model width; o, q/k/v, MLP, gate/up widths
ROWS = 16384  # algorithm.micro_batch_tokens of the long-tailed bench


def host_us_per_call(x: torch.Tensor, weights: dict[int, torch.Tensor], rows: list[int]) -> float:
    """Mean host time in µs of a forward-like and a weight-gradient-like GEMM per width, for each M in rows."""
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    t0 = time.perf_counter()
    for m in rows:
        for n, w in weights.items():
            torch.mm(x[:m, :HIDDEN], w)
            torch.mm(x[:m, :n].t(), x[:m, :HIDDEN])
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return 1e6 * elapsed / (2 * len(rows) * len(weights))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    weights = {n: torch.randn(HIDDEN, n, device="cuda", dtype=torch.bfloat16) for n in WIDTHS}
    x = torch.randn(ROWS, max(WIDTHS), device="cuda", dtype=torch.bfloat16)
    host_us_per_call(x, weights, [ROWS])  # warm: cuBLAS handle, workspace, the kernels of M = ROWS
    first = [ROWS - 128 * i for i in range(1, 11)]  # ten row counts not seen yet, as varlen rows round to 128
    second = [8000 + 128 * i for i in range(10)]
    result = {
        "repeated_us": host_us_per_call(x, weights, [ROWS] * 10),
        "first_seen_us": host_us_per_call(x, weights, first),
        "first_seen_again_us": host_us_per_call(x, weights, first),
        "other_first_seen_us": host_us_per_call(x, weights, second),
        "other_first_seen_again_us": host_us_per_call(x, weights, second),
    }
    for k, v in result.items():
        print(f"{k:28s} {v:9.1f} µs per GEMM call")
    write_json(out_dir(args.out) / "gemm_host_probe.json", {**device_info("cuda"), **result})


if __name__ == "__main__":
    main()
