"""Data-parallel gradient sync without sharding: a bucketed SUM all-reduce launched from inside the last
micro-batch's backward, so it overlaps the rest of that backward, with no copy of the whole gradient.

Every rank's loss is already normalised by the GLOBAL token or sequence count (algo.losses.aggregate), so the exact
gradient is the SUM of the ranks' gradients: no division by the world size. The earlier micro-batches accumulate
locally with no hook and no communication (a rank may run more of them than another). Around the last backward a
post-accumulate-grad hook on each trainable parameter copies its finished gradient into its bucket (≤25 MiB of one
dtype, parameters in reverse order, which is roughly the order backward finishes them) and points `.grad` at that
slice; a bucket whose gradients are all in is all-reduced asynchronously. `finish` launches the rest, where a
parameter the last backward did not reach contributes what it accumulated earlier, or zeros, and waits.

Why not torch's DistributedDataParallel, with `no_sync()` and a SUM comm hook (checked on gloo, torch 2.13):
- DDP decides per synced backward which parameters are unused on every rank and leaves their `.grad` as it is. A
  gradient accumulated only in earlier micro-batches, outside DDP's forward, then stays one rank's own while the
  others have none, and the ranks' weights drift apart. To avoid this, every micro-batch's forward must run inside
  DDP's wrapper forward, so its bucket buffers (a second copy of the whole gradient) live for the whole step while
  the earlier micro-batches' gradients exist beside them, or between steps if the wrapper is kept, when a colocated
  rollout needs that memory. Here the bucket buffers are allocated during the last backward only, and each one
  replaces the gradients it holds.
- Our forwards call compiled layer functions and read weights outside `model.forward` (models/native.py). DDP's
  wrapper forward would run them with dynamo's DDPOptimizer switched on, which splits their compiled graphs.

Invariant: every rank issues the same all-reduces in the same order (bucket 0, 1, ...). A bucket is launched only
after every earlier one, whatever this rank's backward reached first.
"""
from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

log = logging.getLogger("fleetrl.training")

BUCKET_BYTES = 25 * 2**20  # DDP's default: large enough for full bandwidth, small enough to start early


@dataclass(eq=False)
class _Bucket:
    params: list[nn.Parameter]
    offsets: list[int]
    numel: int
    buffer: torch.Tensor | None = None
    pending: set[int] = field(default_factory=set)  # indices into params whose gradient is not in the buffer yet
    work: dist.Work | None = None

    def reset(self) -> None:
        self.buffer, self.work, self.pending = None, None, set(range(len(self.params)))

    def take(self, i: int) -> None:
        """Moves param i's gradient (zeros if it has none) into its slice of the buffer; `.grad` becomes the slice."""
        p = self.params[i]
        if self.buffer is None:
            self.buffer = torch.empty(self.numel, dtype=p.dtype, device=p.device)
        view = self.buffer[self.offsets[i]: self.offsets[i] + p.numel()].view_as(p)
        if p.grad is None:
            view.zero_()
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
        p.grad = view  # the old gradient is freed here: the bucket replaces it rather than doubling it
        self.pending.discard(i)


def _buckets(params: Sequence[nn.Parameter], cap_bytes: int) -> list[_Bucket]:
    buckets: list[_Bucket] = []
    for p in reversed(params):
        last = buckets[-1] if buckets else None
        if (last is None or last.params[0].dtype != p.dtype or last.params[0].device != p.device
                or (last.numel + p.numel()) * p.element_size() > cap_bytes):
            last = _Bucket(params=[], offsets=[], numel=0)
            buckets.append(last)
        last.params.append(p)
        last.offsets.append(last.numel)
        last.numel += p.numel()
    for b in buckets:
        b.reset()
    return buckets


class GradSync:
    """SUM all-reduce of the gradients of `params` over `group`, in buckets launched from the last backward.

    Usage per optimiser step: the earlier micro-batches' backwards as usual, the last one inside `launching()`, then
    `finish()`; afterwards every parameter's `.grad` is the sum over ranks (a view into its bucket)."""

    def __init__(self, params: Sequence[nn.Parameter], group: object | None = None,
                 bucket_bytes: int = BUCKET_BYTES) -> None:
        self.group = group
        self.buckets = _buckets(list(params), bucket_bytes)
        self._where = {p: (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self._next = 0  # the first bucket not launched yet

    @contextmanager
    def launching(self) -> Iterator[None]:
        """The backward run inside launches each bucket once backward has finished all its gradients."""
        hooks = [p.register_post_accumulate_grad_hook(self._ready) for p in self._where]
        try:
            yield
        except BaseException:
            self._reset()  # the step failed: drop the half-filled buckets rather than finish them next step
            raise
        finally:
            for h in hooks:
                h.remove()

    def finish(self) -> None:
        """Launches the buckets not launched yet, in order, then waits for every all-reduce."""
        try:
            for b in self.buckets[self._next:]:
                for i in sorted(b.pending):
                    b.take(i)
            self._launch_ready()
            for b in self.buckets:
                b.work.wait()
        finally:
            self._reset()

    def _reset(self) -> None:
        for b in self.buckets:
            b.reset()  # the gradients keep their buffers (views) until the optimiser's zero_grad drops them
        self._next = 0

    def _ready(self, p: nn.Parameter) -> None:
        bucket, i = self._where[p]
        if bucket.work is not None:
            raise RuntimeError(f"a gradient of a {tuple(p.shape)} parameter arrived after its bucket's all-reduce had "
                               "started: one backward reached the parameter twice (reentrant activation "
                               "checkpointing does that; use_reentrant=False does not)")
        bucket.take(i)  # again if the parameter was reached twice: its `.grad` may have been replaced
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and not self.buckets[self._next].pending:
            b = self.buckets[self._next]
            b.work = dist.all_reduce(b.buffer, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            self._next += 1


def time_all_reduce(device: torch.device, group: object | None = None, nbytes: int = BUCKET_BYTES) -> float:
    """Seconds one SUM all-reduce of a gradient bucket takes (the slowest rank's, so the same on every rank), after
    one untimed (connection set-up); logged with the backend and bus bandwidth."""
    x = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
    dist.all_reduce(x, group=group)
    _drain(device)
    start = time.perf_counter()
    dist.all_reduce(x, group=group)
    _drain(device)
    took = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    dist.all_reduce(took, op=dist.ReduceOp.MAX, group=group)
    seconds, world, backend = float(took), dist.get_world_size(group), dist.get_backend(group)
    bus = nbytes * 2 * (world - 1) / world / max(seconds, 1e-9) / 1e9  # what nccl-tests calls busbw
    extra = ""
    if backend == "nccl":
        # NCCL names its transport (NVLink/P2P, SHM, IB, sockets) only in its own NCCL_DEBUG=INFO output, which
        # goes to the process's stderr, not to us; the bandwidth tells them apart, and the settings are logged.
        knobs = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("NCCL_"))
        extra = f", NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}; {knobs or 'no NCCL_* settings'}"
    log.info("gradient all-reduce: %s over %d ranks, %.0f MiB in %.2f ms (bus bandwidth %.1f GB/s)%s",
             backend, world, nbytes / 2**20, seconds * 1e3, bus, extra)
    return seconds


def _drain(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
