"""Bucketed weight broadcast from trainer rank 0 to separate rollout workers (torch only; no Ray here).

The bus is its own process group (TCPStore + a Gloo or NCCL backend built directly), so it does not
disturb the default group the trainer's data parallelism uses. Both ends iterate their OWN model's
state_dict in the same order (the rollout copy is built from the same config), so no metadata travels:
only flat buckets of `bucket_mb`. With actor.lora only the adapted projections travel, merged (`sync_state`).
Every collective has the bus timeout: a receiver that never shows up makes
the sender fail with a timeout instead of hanging.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

from fleetrl import heartbeat
from fleetrl.config.schema import LoraConfig
from fleetrl.models.lora import merged_targets, target_weight_names

BUCKET_BYTES = 64 << 20  # one broadcast's payload: large enough for the link's speed, small beside the model


class WeightBus:
    def __init__(self, host: str, port: int, rank: int, size: int, *, timeout_s: float, device: torch.device) -> None:
        self.timeout = timedelta(seconds=timeout_s)
        self.rank, self.size = rank, size
        self.device = device
        store = dist.TCPStore(host, port, size, rank == 0, timeout=self.timeout)
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            self.pg = dist.ProcessGroupNCCL(store, rank, size, opts)
        else:
            self.pg = dist.ProcessGroupGloo(store, rank, size, self.timeout)

    def broadcast(self, tensors: list[torch.Tensor]) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = self.timeout
        for t in tensors:
            self.pg.broadcast([t], opts).wait(self.timeout)


def buckets(named: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Groups consecutive same-dtype tensors into buckets of at most bucket_bytes (a larger tensor goes alone)."""
    current: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if current and (size + nbytes > bucket_bytes or t.dtype != current[0][1].dtype):
            yield current
            current, size = [], 0
        current.append((name, t))
        size += nbytes
    if current:
        yield current


def send(bus: WeightBus | None, named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> int:
    """Bus rank 0 sends `named` in buckets; a rank without the bus (an actor rank > 0) only walks `named` whole, as
    its gathers are collectives every actor rank joins in step. Tensors are taken one at a time, so a bucket, not
    the whole gathered model, is what the sender holds at once."""
    if bus is None:
        for _ in named:
            heartbeat.beat()  # each gather is progress; held to rank 0's broadcast pace, this may take a while
        return 0
    sent = 0
    for bucket in buckets(named, bucket_bytes):
        heartbeat.beat()
        flat = torch.cat([t.detach().reshape(-1).to(bus.device) for _, t in bucket])
        bus.broadcast([flat])
        sent += flat.numel() * flat.element_size()
    return sent


class Staging:
    """The receiver's buffers for what `send` broadcasts: one flat buffer per bucket, cut into views shaped like the
    receiver's own tensors. Kept between versions (async: allocated once, beside the decoding engine)."""

    def __init__(self, named: list[tuple[str, torch.Tensor]], bucket_bytes: int, device: torch.device) -> None:
        self.flats: list[torch.Tensor] = []
        self.views: dict[str, torch.Tensor] = {}
        for bucket in buckets(named, bucket_bytes):
            flat = torch.empty(sum(t.numel() for _, t in bucket), dtype=bucket[0][1].dtype, device=device)
            offset = 0
            for name, t in bucket:
                self.views[name] = flat[offset: offset + t.numel()].view_as(t)
                offset += t.numel()
            self.flats.append(flat)

    def receive(self, bus: WeightBus) -> dict[str, torch.Tensor]:
        """Fills the buffers from one `send`; returns the views by name (valid until the next `receive`)."""
        for flat in self.flats:
            heartbeat.beat()
            bus.broadcast([flat])
        return self.views


def receive(bus: WeightBus, named: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> dict[str, torch.Tensor]:
    """`named` are the receiver's own tensors (for shapes/dtypes); returns fresh received tensors by name."""
    return Staging(named, bucket_bytes, bus.device).receive(bus)


def full_state(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Named full tensors in state_dict order; sharded (DTensor) parameters are gathered on every rank."""
    return [(name, whole(t)) for name, t in model.state_dict().items()]


def whole(t: torch.Tensor) -> torch.Tensor:
    """The full tensor of a sharded (DTensor) one, gathered from every rank (a collective), or `t` itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def sync_state(model: torch.nn.Module, lora: LoraConfig | None) -> list[tuple[str, torch.Tensor]]:
    """What the actor publishes: every tensor, or with LoRA only the merged adapted weights W + ΔW (the frozen
    rest — embeddings, norms, unadapted layers — never changes, and the receiver already holds it)."""
    return list(iter_sync_state(model, lora))


def iter_sync_state(model: torch.nn.Module, lora: LoraConfig | None) -> Iterator[tuple[str, torch.Tensor]]:
    """`sync_state` one tensor at a time, each gathered (a collective: every rank iterates it whole, in step) only
    when it is reached, so a consumer that drops each one never holds the whole gathered model."""
    # Sharded (FSDP2): W and the adapters are DTensor shards, so the merge is too; gathered here like full_state.
    named = model.state_dict().items() if lora is None else merged_targets(model)
    for name, t in named:
        yield name, whole(t)


def receive_layout(model: torch.nn.Module, lora: LoraConfig | None) -> tuple[list[tuple[str, torch.Tensor]], bool]:
    """(the receiver's own tensors that `sync_state` will fill, in its order; whether that is a subset). The
    receiver's plain model resolves actor.lora.targets to the same module names, in the same module order."""
    if lora is None:
        return full_state(model), False
    own = dict(model.state_dict())
    return [(name, own[name]) for name in target_weight_names(model, lora)], True
