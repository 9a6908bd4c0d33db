"""Data-parallel gradient sync without sharding: a bucketed SUM all-reduce launched from inside the last
micro-batch's backward, so it overlaps the rest of that backward, with no copy of the whole gradient.

Every rank's loss is already normalised by the GLOBAL token or sequence count (algo.losses.aggregate), so the exact
gradient is the SUM of the ranks' gradients: no division by the world size. The earlier micro-batches accumulate
locally with no hook and no communication (a rank may run more of them than another). Around the last backward a
post-accumulate-grad hook on each trainable parameter marks its gradient finished. Parameters are in buckets of up
to 25 MiB of one dtype, in reverse order, roughly the order in which backward finishes them. Once a bucket's
gradients are all finished, it gathers them into one buffer (one `cat`), points each `.grad` at its slice (freeing
the gradient that slice replaces, so the bucket never doubles it) and starts an async all-reduce. `finish` launches
the rest and waits. A parameter that the last backward did not reach sends what earlier micro-batches accumulated,
or zeros.

Why not torch's DistributedDataParallel, with `no_sync()` and a SUM comm hook (checked on gloo, torch 2.13):
- DDP decides per synced backward which parameters are unused on every rank and leaves their `.grad` as it is. A
  gradient accumulated only in earlier micro-batches, outside DDP's forward, then stays one rank's own while the
  others have none, and the ranks' weights drift apart. To avoid this, every micro-batch's forward must run inside
  DDP's wrapper forward, so its bucket buffers (a second copy of the whole gradient) live for the whole step while
  the earlier micro-batches' gradients exist beside them, or between steps if the wrapper is kept, when a colocated
  rollout needs that memory.
- Our forwards call compiled layer functions and read weights outside `model.forward` (models/native.py). DDP's
  wrapper forward would run them with dynamo's DDPOptimizer switched on, which splits their compiled graphs.
The price is CPU time. DDP's reducer runs in C++; here each parameter costs a Python hook, and each bucket costs a
collective issued from Python, on the thread that launches the backward's kernels. The test: 2×H100 over NVLink,
NCCL, a 0.5B Qwen2 shape with fp32 weights and bf16 autocast, HF's eager forward, one micro-batch of 4096 tokens,
medians of 15 interleaved steps. A step without sync took 89-91 ms. With the flat all-reduce this replaced it took
110 ms, 13 ms of it exposed. An earlier version of these hooks took 116 ms, ~1 ms exposed. A kept DDP wrapper took
105 ms. Both overlaps hide the all-reduce, but in a launch-bound backward the hooks cost about what the overlap
saved. Over a slower network (several nodes) the exposed all-reduce dominates, and here it is hidden.

Invariant: every rank issues the same all-reduces in the same order (bucket 0, 1, ...). A bucket is launched only
after every earlier one, whatever this rank's backward reached first.
"""
from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

log = logging.getLogger("fleetrl.training")

BUCKET_BYTES = 25 * 2**20  # DDP's default: large enough for full bandwidth, small enough to start early


@dataclass(eq=False)
class _Bucket:
    params: list[nn.Parameter]
    numel: int = 0
    pending: set[int] = field(default_factory=set)  # ids of the parameters the last backward has not finished yet
    work: dist.Work | None = None

    def launch(self, group: object | None) -> None:
        """Gathers the bucket's gradients (zeros for a parameter with none) into one buffer, points each `.grad` at
        its slice (freeing the gradient it replaces: the bucket never doubles it) and starts the all-reduce."""
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in self.params]
        # one parameter: its own gradient is the buffer (no copy)
        buffer = torch.cat([g.reshape(-1) for g in grads]) if len(grads) > 1 else grads[0].reshape(-1)
        for p, view in zip(self.params, buffer.split([p.numel() for p in self.params])):
            p.grad = view.view_as(p)
        self.work = dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group, async_op=True)


def _buckets(params: Sequence[nn.Parameter], cap_bytes: int) -> list[_Bucket]:
    buckets: list[_Bucket] = []
    for p in reversed(params):
        last = buckets[-1] if buckets else None
        if (last is None or last.params[0].dtype != p.dtype or last.params[0].device != p.device
                or (last.numel + p.numel()) * p.element_size() > cap_bytes):
            last = _Bucket(params=[])
            buckets.append(last)
        last.params.append(p)
        last.numel += p.numel()
    return buckets


class GradSync:
    """SUM all-reduce of the gradients of `params` over `group`, in buckets launched from the last backward.

    Usage per optimiser step: the earlier micro-batches' backwards as usual, the last one inside `launching()`, then
    `finish()`; afterwards every parameter's `.grad` is the sum over ranks (a view into its bucket)."""

    def __init__(self, params: Sequence[nn.Parameter], group: object | None = None,
                 bucket_bytes: int = BUCKET_BYTES) -> None:
        self.group = group
        self.buckets = _buckets(list(params), bucket_bytes)
        self._next = 0  # the first bucket not launched yet

    @contextmanager
    def launching(self) -> Iterator[None]:
        """The backward run inside launches each bucket once backward has finished all its gradients. The hooks
        live for this backward only (registering ~300 costs under a millisecond; left in place, each would cost a
        Python call in every earlier micro-batch's backward)."""
        hooks = []
        for b in self.buckets:
            b.pending, b.work = {id(p) for p in b.params}, None
            hooks += [p.register_post_accumulate_grad_hook(partial(self._ready, b)) for p in b.params]
        self._next = 0
        try:
            yield
        except BaseException:
            self._reset()  # the step failed: nothing is left half-launched for the next step to finish
            raise
        finally:
            for h in hooks:
                h.remove()

    def finish(self) -> None:
        """Launches the buckets not launched yet, in order (a parameter the last backward did not reach sends what
        earlier micro-batches accumulated, or zeros), then waits for every all-reduce."""
        try:
            while self._next < len(self.buckets):
                self._launch_next()
            for b in self.buckets:
                # bounded: the process group's timeout (cluster.init_timeout_s, workers/worker.py init_dist) ends
                # a collective whose peer died, and the controller's watchdog reports a rank stuck here first
                b.work.wait()
        finally:
            self._reset()

    def _reset(self) -> None:
        for b in self.buckets:
            b.work = None  # the gradients keep their buffers (views) until the optimiser's zero_grad drops them
        self._next = 0

    def _ready(self, bucket: _Bucket, p: nn.Parameter) -> None:
        if bucket.work is not None:
            raise RuntimeError(f"a gradient of a {tuple(p.shape)} parameter arrived after its bucket's all-reduce had "
                               "started: one backward reached the parameter twice (reentrant activation "
                               "checkpointing does that; use_reentrant=False does not)")
        bucket.pending.discard(id(p))  # reached twice before the launch: the gradient read then holds both
        while self._next < len(self.buckets) and not self.buckets[self._next].pending:
            self._launch_next()

    def _launch_next(self) -> None:
        self.buckets[self._next].launch(self.group)
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
