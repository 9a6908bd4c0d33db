"""CUDA graphs of the decode step, one per (batch bucket, kv-length bucket, sampling mode), captured lazily.

All graphs share one memory pool: their tensors are temporaries only (every result is written into the
engine's static buffers), so no graph depends on pool memory surviving between its replays and any replay
order is safe.

Cost: with the Triton kernels (which read each slot's own length) there is one graph per batch bucket and
sampling mode, captured on first use; each capture runs the step twice (warm-up, capture), i.e. ~14 captures
of a few ms each for max_batch 512. The pool holds about the largest graph's temporaries, dominated by its
logits: max_batch x vocab x element size (512 x 151,936 x 2 bytes = 156 MB for Qwen2.5 in bf16).
"""
from __future__ import annotations

from typing import Callable, Hashable

import torch

BUCKET_STEP = 64  # above 128 slots, buckets grow by this many


def batch_buckets(max_batch: int) -> list[int]:
    """Powers of two up to 128, then multiples of 64, capped by and ending at max_batch:
    [1, 2, 4, ..., 128, 192, 256, 320, ..., max_batch]. Above 128 a power-of-two step would pad up to 2x: a call
    of 300 rows would get 512 slots of KV cache and decode 512 rows per step; with steps of 64 it gets 320."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b = b * 2 if b < 2 * BUCKET_STEP else b + BUCKET_STEP
    return out + [max_batch]


def bucket_for(n: int, buckets: list[int]) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise AssertionError(f"{n} slots exceed the largest bucket {buckets[-1]}")


class DecodeGraphs:
    """`run(key)` replays the graph of `step(key)`, capturing it on first use.

    Warm-up before capture runs the step for real (cuBLAS handles, Triton compilation), so the buffers it
    advances are saved and restored; the cache rows it writes are rewritten with identical values by the
    real step that follows.
    """

    def __init__(self, step: Callable[[Hashable], None], state: list[torch.Tensor]) -> None:
        self._step = step
        self._state = state
        self._graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle()

    def __len__(self) -> int:
        return len(self._graphs)

    def run(self, key: Hashable) -> None:
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = self._capture(key)
        graph.replay()

    def _capture(self, key: Hashable) -> torch.cuda.CUDAGraph:
        saved = [t.clone() for t in self._state]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._step(key)
        torch.cuda.current_stream().wait_stream(side)
        for t, s in zip(self._state, saved):
            t.copy_(s)
        graph = torch.cuda.CUDAGraph()
        # thread_local: an async rollout worker receives weights on another thread while this one may capture
        # (cluster/group.py bus_offer); the default (global) mode would fail that thread's stream sync mid-capture
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            self._step(key)
        return graph
