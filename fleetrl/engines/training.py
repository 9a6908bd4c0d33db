"""Training engine: one model on one device, with its optimiser, schedule and data-parallel gradient sync.

Data parallelism: every rank sums its micro-batch losses, each already normalised by the GLOBAL token or
sequence count of the mini-batch (see algo.losses.aggregate), so the exact full-batch gradient is the SUM of
the ranks' gradients. Only the last micro-batch's backward communicates:
- unsharded (engines/grad_sync.py): the earlier micro-batches accumulate locally, and the last backward launches a
  bucketed SUM all-reduce (25 MiB buckets, no copy of the whole gradient) that overlaps the rest of it. Ranks may
  run different numbers of micro-batches; a parameter a rank did not use contributes zeros.
- `sharded=True` (and a process group, of one rank or more): FSDP2 (engines/sharding.py; NCCL on GPU, gloo on
  CPU), its reduce-scatter set to SUM, after every micro-batch's backward: the gradients stay sharded. (Deferring
  the sync to the last micro-batch keeps every layer's unsharded gradient until then: +30 GB a rank for a 7B
  actor, which ran 4x H100 out of memory on 2026-11-27; sharding exists to save that memory.) FSDP2 gathers every layer in every forward, so all ranks run as many micro-batches: a rank with
  fewer re-cuts its rows into the most any rank has (`step`'s `split`) rather than padding with repeats.
With more than one rank, the engine times one all-reduce of a bucket at build, logs it with the backend and bus
bandwidth, and reports it with every step as `allreduce_s`.

Mixed precision: with `autocast_dtype` (e.g. bfloat16) the forward of each micro-batch runs under
torch.autocast, so matmuls run in bf16 while parameters, gradients and Adam state stay in the model dtype
(fp32 master weights: a pure-bf16 model would round away updates smaller than 2^-8 of a weight, e.g. every
lr=1e-6 step). On a CPU with AVX512-BF16 this halves the update time of SmolLM2-135M (bench/cpu_smollm2.py).
"""
from __future__ import annotations

import logging
import math
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from fleetrl import heartbeat
from fleetrl.config.schema import OptimConfig
from fleetrl.engines.grad_sync import GradSync, time_all_reduce
from fleetrl.engines.sharding import same_count_on_every_rank, shard
from fleetrl.models.hf import release_freed_memory

log = logging.getLogger("fleetrl.training")
T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    group: object | None = None  # a torch.distributed ProcessGroup, None = default group

    @property
    def active(self) -> bool:
        return self.world_size > 1


def make_scheduler(opt: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int | None) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up, then constant / linear / cosine decay to min_lr_ratio over total_steps optimiser steps."""
    warm, floor = cfg.warmup_steps, cfg.min_lr_ratio
    total = max(total_steps or 1, 1)

    def factor(step: int) -> float:
        if warm and step < warm:
            return (step + 1) / warm
        if cfg.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warm) / max(1, total - warm))
        decay = 1 - progress if cfg.schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
        return floor + (1 - floor) * decay

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


class TrainingEngine:
    """Owns params + optimiser + schedule; `step(micro_batches, loss_fn)` does one optimiser step."""

    def __init__(self, model: nn.Module, optim: OptimConfig, *, dist_info: DistInfo = DistInfo(),
                 total_optimizer_steps: int | None = None, device: torch.device | str = "cpu",
                 sharded: bool = False, autocast_dtype: torch.dtype | None = None) -> None:
        self.model = model
        self.autocast_dtype = autocast_dtype
        self.dist = dist_info
        self.device = torch.device(device)
        # The time of one gradient all-reduce of a bucket (seconds), measured once here; None on one rank.
        self.allreduce_s: float | None = None
        if dist_info.active:
            from fleetrl.engines.replicas import check_alike, unshared

            # What the loader built alike on every rank is checked, not sent (engines/replicas.py).
            _broadcast_from_rank0(unshared(model), dist_info.group)
            check_alike(model, dist_info.group)
            self.allreduce_s = time_all_reduce(self.device, dist_info.group)
        # One rank too, when the worker made a group for it (workers/worker.py `init_dist`): FSDP2 with one shard.
        self.sharded = sharded and dist.is_initialized()
        if sharded and not self.sharded:
            log.warning("sharding=fsdp2 without a process group: the model is not sharded")
        # FSDP2 on a torch without its sum-only switch averages over ranks; the loss is scaled to undo that.
        self._loss_scale = 1.0
        if self.sharded:
            if not dist_info.active:
                log.warning("sharding=fsdp2 on one rank: FSDP2 with one shard saves no memory and costs time (4-14% "
                            "of a 0.5B step on an H200, bench/RESULTS.md, fourteenth round); it runs the sharded "
                            "code path as N ranks would. Set sharding=none for one-GPU speed")
            if not shard(model, _decoder_layers(model)):
                self._loss_scale = float(dist_info.world_size)
        params = [p for p in model.parameters() if p.requires_grad]
        self._grad_sync = GradSync(params, dist_info.group) if dist_info.active and not self.sharded else None
        # CUDA: the fused kernel. CPU: the per-parameter loop, not foreach: foreach saves kernel launches (none on
        # CPU) but builds temporaries for every parameter at once (+1 model size, 540 MB for SmolLM2-135M).
        fused = self.device.type == "cuda"
        self.optimizer = torch.optim.AdamW(params, lr=optim.lr, betas=optim.betas, eps=optim.eps,
                                           weight_decay=optim.weight_decay, foreach=False, fused=fused or None)
        self.scheduler = make_scheduler(self.optimizer, optim, total_optimizer_steps)
        self.grad_clip = optim.grad_clip

    def step(self, micro_batches: Iterable[T], loss_fn: Callable[[T], tuple[torch.Tensor, dict[str, float]]], *,
             split: Callable[[int], Sequence[T]] | None = None) -> dict[str, float]:
        """Accumulates gradients over micro-batches, syncs them across ranks, clips, steps.

        loss_fn returns (loss, metrics) for a micro-batch; the loss must already be normalised by global counts.
        split(n): this rank's rows cut into n micro-batches, each row in exactly one, in order; under FSDP2 a rank
        with fewer micro-batches than another re-cuts with it (without it, it repeats its last with a zero loss).
        Returns summed metrics plus grad_norm and lr, and allreduce_s with more than one rank. A non-finite grad
        norm skips the update (counted).
        """
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        # Metrics may be 0-dim device tensors: they are summed on the device and read back once, with the gradient
        # norm. A read per micro-batch (float(tensor)) would make the host wait for the GPU to drain before
        # it could queue the backward, leaving the GPU idle while it does.
        totals: dict[str, float | torch.Tensor] = {}
        nonfinite: torch.Tensor | float = 0.0
        passes = self.aligned(micro_batches, split)
        for i, (mb, real) in enumerate(passes):
            heartbeat.beat()
            with self._syncing(last=i == len(passes) - 1):
                with self.autocast():
                    loss, metrics = loss_fn(mb)
                if not real:  # a repeat that keeps FSDP2's collectives in step with other ranks: adds no gradient
                    (loss * 0.0).backward()
                    continue
                (loss * self._loss_scale if self._loss_scale != 1.0 else loss).backward()
            nonfinite = nonfinite + (~torch.isfinite(loss.detach())).float()
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + (v.detach() if isinstance(v, torch.Tensor) else float(v))
        if self._grad_sync is not None:
            self._grad_sync.finish()  # also on a rank with no micro-batch: it contributes zeros
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, self.grad_clip if self.grad_clip > 0 else float("inf"))
        # the metrics and the norm in one read-back: each read waits for the GPU to drain, and it then idles
        # while the host queues the next kernels
        totals = read_back({**totals, "nonfinite_loss": nonfinite,
                            "grad_norm": norm.full_tensor() if hasattr(norm, "full_tensor") else norm})
        norm = totals.pop("grad_norm")
        lr = self.scheduler.get_last_lr()[0]
        if math.isfinite(norm):
            self.optimizer.step()
            totals["skipped"] = 0.0
        else:
            totals["skipped"] = 1.0  # a NaN/inf gradient must not poison the weights
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cpu":
            # The step's activations and gradients are freed into glibc's heap, which keeps them resident
            # (measured on SmolLM2-135M: 3.56 GiB after a step, 1.95 GiB after the trim); the next phase
            # (generation) would otherwise start from the update's high-water mark.
            release_freed_memory(collect=False)  # the step's tensors hold no cycles: refcounting freed them
        if self.allreduce_s is not None:
            totals["allreduce_s"] = self.allreduce_s
        return {**totals, "grad_norm": norm, "lr": lr}

    def aligned(self, micro_batches: Iterable[T], split: Callable[[int], Sequence[T]] | None = None) -> list[tuple[T, bool]]:
        """(micro-batch, real) pairs; under FSDP2 as many on every rank (engines/sharding.py), re-cut with `split`
        where given, else padded with repeats flagged not real."""
        if not self.sharded:
            return [(mb, True) for mb in micro_batches]
        return same_count_on_every_rank(micro_batches, self.device, self.dist.group, split)

    def _syncing(self, last: bool) -> AbstractContextManager:
        """The context of one micro-batch's forward and backward: only the last one's backward syncs gradients."""
        if last and self._grad_sync is not None:
            return self._grad_sync.launching()
        return nullcontext()

    def autocast(self) -> AbstractContextManager:
        """The forward's mixed-precision context (a no-op without autocast_dtype); backward runs outside it."""
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def offload_optimizer(self) -> None:
        """Moves optimiser state (Adam moments: 2× the parameters in fp32/bf16) to CPU while a colocated phase
        such as generation needs the GPU memory; `onload_optimizer` brings it back before the next step."""
        self._move_optimizer_state("cpu")

    def onload_optimizer(self) -> None:
        self._move_optimizer_state(self.device)

    def _move_optimizer_state(self, device: torch.device | str) -> None:
        for state in self.optimizer.state.values():
            for k, v in state.items():
                # "step" stays where it is: fused/foreach Adam keep it as a CPU (or device) scalar by design.
                if torch.is_tensor(v) and k != "step":
                    state[k] = v.to(device, non_blocking=True)
        if torch.device(device).type == "cpu" and torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])


@torch.no_grad()
def _broadcast_from_rank0(params: list[torch.Tensor], group: object | None) -> None:
    """Every rank starts from rank 0's trainable weights, as DDP does. Why: weights a run creates rather than
    loads (peft's LoRA A matrices) are drawn from each worker's generator, which is seeded by its rank, so the
    ranks' adapters would differ and data parallelism would average gradients of different models."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    for p in params:
        dist.broadcast(p.data, src=src, group=group)


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    for name in ("model.layers", "model.model.layers", "backbone.layers", "layers"):
        mod = model
        try:
            for part in name.split("."):
                mod = getattr(mod, part)
            return list(mod)
        except AttributeError:
            continue
    return []


def read_back(values: dict[str, float | torch.Tensor]) -> dict[str, float]:
    """Floats of `values`, its tensors read back from the device in one transfer."""
    keys = [k for k, v in values.items() if isinstance(v, torch.Tensor)]
    out = {k: float(v) for k, v in values.items() if k not in keys}
    if keys:
        out.update(zip(keys, torch.stack([values[k].float().reshape(()) for k in keys]).tolist()))
    return out
