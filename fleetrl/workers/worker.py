"""Worker: one process (one Ray actor, or the driver itself) hosting every role of its pool.

Roles in one pool are colocated: the actor, its rollout engine and the reference share the process and
device, and the rollout engine generates with the actor's own parameters (no copy). The class knows nothing
about Ray; `cluster/group.py` places it.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from fleetrl import heartbeat
from fleetrl.batch import Batch
from fleetrl.cachedir import use_node_compile_cache
from fleetrl.engines.sync_check import SyncProbe
from fleetrl.engines.training import DistInfo
from fleetrl.netif import socket_ifname_env
from fleetrl.workers.context import WorkerContext
from fleetrl.workers.host_stage import HostStage
from fleetrl.workers.memory import bound_onednn_caches, memory_peaks
from fleetrl.workers.messages import (
    GenerateRequest,
    PrepareReport,
    PrepareRequest,
    RolloutReport,
    UpdateMetrics,
    UpdateSpec,
)
from fleetrl.workers.sync_faults import skip_received
from fleetrl.workers.tp_group import EngineGroup

if TYPE_CHECKING:  # imported where first used (Worker._local): local_step imports this module's neighbours
    from fleetrl.workers.local_step import LocalStep

log = logging.getLogger("fleetrl.worker")


class Worker:
    def __init__(self, ctx: WorkerContext) -> None:
        _drop_conflicting_env()
        self.ctx = ctx
        self.actor = self.critic = self.ref = self.rollout = self.reward_model = None
        self.bus = None  # weight bus to a separate rollout pool (only actor rank 0 and rollout workers join)
        self.owns_group = False  # this worker made the process's default group (init_dist), so it destroys it
        self.local: LocalStep | None = None  # the rank-local step's held groups (workers/local_step.py), built on first use
        self.startup_s: dict[str, float] = {}  # seconds of each part of `build`
        self.engine_group: EngineGroup | None = None  # rollout.tensor_parallel > 1: this rank's engine (tp_group.py)
        self.stage = HostStage()  # async publish: actor rank 0's host buffers (none until its first export)

    def timed(self, method: str, *args):
        """Runs one verb and returns (result, seconds spent inside this process) so the caller can tell
        compute from transport overhead."""
        heartbeat.maybe_freeze(method)
        t0 = time.perf_counter()
        out = getattr(self, method)(*args)
        return out, time.perf_counter() - t0

    def progress(self) -> int:
        """The process's heartbeat count, read by the watchdog through the actor's free concurrency slot."""
        return heartbeat.count()

    # ------------------------------------------------------------------ setup
    def node_info(self) -> dict:
        return {"hostname": socket.gethostname(), "ip": _own_ip(), "pid": os.getpid(), "rank": self.ctx.rank,
                "pool": self.ctx.pool, "roles": list(self.ctx.roles),
                "node_id": os.environ.get("FLEETRL_NODE_ID", ""),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def master_address(self) -> tuple[str, int]:
        """Rank 0 publishes its address and a free port for the pool's process group."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return _own_ip(), port

    def init_dist(self, addr: str, port: int, timeout_s: float) -> None:
        w = self.ctx.world_size
        # A sharded role gets a group even at one rank: sharding=fsdp2 then runs FSDP2's own code path (one shard),
        # the same as at N ranks, instead of silently none.
        sharded = self.ctx.sharded("actor") or self.ctx.sharded("critic")
        if w == 1 and sharded and dist.is_initialized():
            # cluster.backend=local: another pool's worker in this process made the one-rank group already.
            return
        if w > 1 or sharded:
            self.owns_group = True
            _pin_socket_ifname()
            backend = "nccl" if self.ctx.device().type == "cuda" else "gloo"
            dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=self.ctx.rank,
                                    world_size=w, timeout=timedelta(seconds=timeout_s))
        if "rollout" in self.ctx.roles:  # every rank of the pool makes every engine's group, in order
            self.engine_group = EngineGroup.make(self.ctx.rank, w, self.ctx.cfg.rollout.tensor_parallel)

    def build(self) -> None:
        """Loads models for every hosted role (after init_dist, so sharding can use the group)."""
        from fleetrl.workers.actor import (
            ActorComponent,
            RefComponent,
            load_policy_model,
        )

        ctx = self.ctx
        ctx.seed_everything()
        use_node_compile_cache()  # before anything compiles: the ranks of a node share one cache
        bound_onednn_caches()  # before the first bf16 matmul: a shape-keyed cache must not grow all run
        info = DistInfo(rank=ctx.rank, world_size=ctx.world_size)
        roles = set(ctx.roles)
        model = None
        clock = _Clock()
        if "actor" in roles or "rollout" in roles:
            model = clock.time("load", load_policy_model, ctx, trainable="actor" in roles)
        if "actor" in roles:
            self.actor = clock.time("actor", ActorComponent, ctx, model, info)
        if "rollout" in roles:
            from fleetrl.workers.rollout import RolloutComponent

            self.rollout = clock.time("rollout", RolloutComponent, ctx, model, self.engine_group)
        if "ref" in roles:
            self.ref = clock.time("ref", RefComponent, ctx, self.actor if ctx.plan.ref_from_actor else None)
        if "critic" in roles:
            from fleetrl.workers.critic import CriticComponent

            self.critic = clock.time("critic", CriticComponent, ctx, info)
        if "reward_model" in roles:
            from fleetrl.workers.reward_model import RewardModelComponent

            self.reward_model = RewardModelComponent(ctx)
        # Seconds of each part of the build (the actor's split into its engine and its draw): bench/startup.py.
        self.startup_s = {**clock.seconds, **{f"actor/{k}": v for k, v in getattr(self.actor, "startup_s", {}).items()}}
        log.info("rank %d built in %s", ctx.rank, ", ".join(f"{k} {v:.1f}s" for k, v in self.startup_s.items()))

    # ------------------------------------------------------------------ verbs
    def generate(self, batch: Batch, req: GenerateRequest) -> Batch:
        offload = self.actor is not None and self.ctx.cfg.actor.offload_optimizer
        t0 = time.perf_counter()
        if offload:
            self.actor.engine.offload_optimizer()  # synchronous: the memory must be free before the engine runs
        t1 = time.perf_counter()
        try:
            rollout = self._need("rollout")
            # partial rollouts: the newest published weights between segments (a plain call keeps the 2-argument
            # form, which benchmarks wrap: bench/longtail.py)
            out = rollout.generate(batch, req) if req.segment_tokens is None else \
                rollout.generate(batch, req, self.install_newest)
        finally:
            t2 = time.perf_counter()
            if offload:
                self.actor.engine.onload_optimizer()
        if offload:
            # The optimiser's trip to the host and back is part of this phase, and on a large model it can rival
            # the decode, so it is reported (train/time/generate/*, docs/architecture.md "Phase timings"); the
            # sync times the onload's copies, which the update would wait for anyway.
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            out.meta.setdefault("timing", {}).update({"generate/offload_optimizer": t1 - t0,
                                                      "generate/onload_optimizer": time.perf_counter() - t2})
        return out

    def compute_logprobs(self, batch: Batch) -> Batch:
        return self._need("actor").compute_logprobs(batch)

    def compute_ref_logprobs(self, batch: Batch) -> Batch:
        return self._need("ref").compute_ref_logprobs(batch)

    def compute_values(self, batch: Batch) -> Batch:
        return self._need("critic").compute_values(batch)

    def score_rm(self, batch: Batch) -> Batch:
        return self._need("reward_model").score(batch)

    def update_actor(self, batch: Batch, spec: UpdateSpec) -> UpdateMetrics:
        return self._with_memory(self._need("actor").update(batch, spec))

    def update_critic(self, batch: Batch, spec: UpdateSpec) -> UpdateMetrics:
        return self._with_memory(self._need("critic").update(batch, spec))

    def _with_memory(self, metrics: UpdateMetrics) -> UpdateMetrics:
        """Adds this process's memory peaks (workers/memory.py) since its previous update report: everything it
        did in between counts (generate, log-probs, values, the update), since peaks are per process, not per
        role. A worker hosting both critic and actor splits its step between the two reports, which the
        controller combines by max. Pools with no trained role (a separate rollout or reward-model pool) report
        none."""
        return metrics.with_extremes(memory_peaks(self.ctx.device()))

    # ------------------------------------------------------------------ the rank-local step (Plan.rank_local)
    def rollout_local(self, prompts: Batch, req: GenerateRequest) -> RolloutReport:
        return self._local().rollout(prompts, req)

    def prepare_local(self, req: PrepareRequest) -> PrepareReport:
        return self._local().prepare(req)

    # No _with_memory here: LocalStep.update goes through update_actor/update_critic, which add the peaks. Read a
    # second time, the peak would be the RSS just after the update (the first read reset it).
    def update_actor_local(self, spec: UpdateSpec) -> UpdateMetrics:
        return self._local().update("actor", spec)

    def update_critic_local(self, spec: UpdateSpec) -> UpdateMetrics:
        return self._local().update("critic", spec)

    def _local(self) -> "LocalStep":
        if self.local is None:
            from fleetrl.workers.local_step import LocalStep

            self.local = LocalStep(self)
        return self.local

    def mark_weights_version(self, version: int) -> None:
        """Colocated rollout: the engine reads the actor's parameters (only the version moves), or, for vLLM, takes
        a copy of them (workers/rollout.py `mark_version`)."""
        self._need("rollout").mark_version(version)

    # ------------------------------------------------------ policy check after a sync (engines/sync_check.py)
    def check_sync(self, version: int) -> float:
        """Colocated: this rank's engine samples the probe and its actor scores it; the gap is all that leaves."""
        return self._need("actor").probe_gaps([self._need("rollout").probe(version)])[0]

    def sync_probe(self, version: int) -> SyncProbe:
        """Separate rollout pool: the engine's side of the check, handed to the actor's ranks by reference."""
        return self._need("rollout").probe(version)

    def probe_gaps(self, probes: list[SyncProbe]) -> list[float]:
        """The actor's side: the gap of each rollout worker's probe (every rank runs it: FSDP2 gathers)."""
        return self._need("actor").probe_gaps(probes)

    # ------------------------------------------------------ weight bus (separate rollout pool)
    def bus_join(self, host: str, port: int, bus_rank: int, size: int, timeout_s: float) -> None:
        from fleetrl.workers.weight_bus import WeightBus

        if bus_rank >= 0:
            self.bus = WeightBus(host, port, bus_rank, size, timeout_s=timeout_s, device=self.ctx.device())

    def bus_send(self, bucket_bytes: int) -> int:
        """Every actor rank gathers (sharded params need all ranks); only bus rank 0 (actor rank 0) sends."""
        from fleetrl.workers.weight_bus import iter_sync_state, send

        return send(self.bus, iter_sync_state(self._need("actor").model, self.ctx.cfg.actor.lora), bucket_bytes)

    def bus_receive(self, bucket_bytes: int, version: int) -> int:
        from fleetrl.workers.weight_bus import receive, receive_layout

        own, partial = receive_layout(self._need("rollout").engine_model(), self.ctx.cfg.actor.lora)
        self.install_weights(receive(self.bus, own, bucket_bytes), version)
        return version

    def export_weights(self) -> dict[str, torch.Tensor] | None:
        """Async weight path: what `bus_send` would send, in host memory on actor rank 0 (None on the others), valid
        until the next export (workers/host_stage.py keeps the buffers). Every rank runs it: sharded parameters are
        gathered collectively, one tensor at a time, and each is dropped once copied."""
        from fleetrl.workers.weight_bus import iter_sync_state

        named = iter_sync_state(self._need("actor").model, self.ctx.cfg.actor.lora)
        if self.ctx.rank != 0:
            for _ in named:  # joins each gather, keeps nothing
                pass
            return None
        return self.stage.copy(named)

    def install_weights(self, received: dict[str, torch.Tensor], version: int) -> None:
        """Loads `sync_state`'s tensors (from the bus or the object store) into the rollout engine."""
        rollout = self._need("rollout")
        # A no-op unless the FLEETRL_FAULT_SYNC_SKIP test hook is set (workers/sync_faults.py).
        received = skip_received(received, lambda: rollout.engine_model().state_dict())
        if self.ctx.cfg.actor.lora is not None:  # only the adapted projections travelled; engines take whole state
            received = {**rollout.engine_model().state_dict(), **received}  # dicts: the rest is the engine's own
        rollout.load_weights(received, version)

    def weights_version(self) -> int:
        return self._need("rollout").engine.weights_version

    def install_newest(self) -> None:
        """Partial rollouts: between two segments of a generate call, the newest weights published to this worker
        (async: cluster/group.py `offer_weights`); nothing here, where no weights are published to a worker."""

    # ------------------------------------------------------------------ checkpoints
    def _engines(self) -> dict:
        return {r: getattr(self, r).engine for r in ("actor", "critic") if getattr(self, r) is not None}

    def save_state(self, ckpt_dir: str) -> None:
        from fleetrl.workers.state import save_extras, save_trainable

        root = Path(ckpt_dir)
        with heartbeat.beating():  # one write of a large state may outlast cluster.stall_s with nothing to count
            for role, engine in self._engines().items():
                save_trainable(root / role, engine, self.ctx.rank)
            save_extras(root / "workers" / f"{self.ctx.pool}_r{self.ctx.rank}.pt", self._engines())
        if dist.is_initialized():
            dist.barrier()  # rank 0's unsharded write must finish before anyone reports success

    def load_state(self, ckpt_dir: str) -> None:
        from fleetrl.workers.state import load_extras, load_trainable

        root = Path(ckpt_dir)
        with heartbeat.beating():
            for role, engine in self._engines().items():
                load_trainable(root / role, engine)
            load_extras(root / "workers" / f"{self.ctx.pool}_r{self.ctx.rank}.pt", self._engines())

    def model_state(self, role: str) -> dict[str, torch.Tensor]:
        """The role's weights under plain HF names (a LoRA actor's adapters merged in)."""
        from fleetrl.models.lora import merged_state_dict
        from fleetrl.workers.weight_bus import whole

        comp = self._need(role)
        # Sharded (FSDP2) weights are gathered whole; every rank must call this (call_all), as for weight sync.
        return {k: whole(v).detach().cpu().clone() for k, v in merged_state_dict(comp.model).items()}

    def local_shapes(self, role: str) -> dict[str, tuple[int, ...]]:
        """The shape of what this rank holds of each of the role's parameters: its shard under FSDP2 (dim 0
        split across the ranks), else the whole tensor. Shows that a sharded role really is sharded."""
        comp = self._need(role)
        return {name: tuple(p.to_local().shape if hasattr(p, "to_local") else p.shape)
                for name, p in comp.model.named_parameters()}

    def shutdown(self) -> None:
        if self.local is not None:
            self.local.close()  # its reward workers
            self.local = None
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_group = False

    def _need(self, role: str):
        comp = getattr(self, role)
        if comp is None:
            raise RuntimeError(f"worker rank {self.ctx.rank} of pool '{self.ctx.pool}' hosts roles "
                               f"{list(self.ctx.roles)}, not '{role}'")
        return comp


class _Clock:
    """Seconds of each named part of a build."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def time(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.seconds[name] = time.perf_counter() - t0


def _own_ip() -> str:
    # The Ray wrapper in cluster/group.py sets this to the node IP Ray was started with; in-process: loopback.
    return os.environ.get("FLEETRL_NODE_IP", "127.0.0.1")


def _pin_socket_ifname() -> None:
    """Binds Gloo/NCCL to the interface of this node's Ray IP when nothing else has chosen one (`cluster up`
    sets both for the raylet; a plain `ray start` does not). On loopback, or an IP no interface holds, the
    libraries keep their own choice."""
    ip = _own_ip()
    if ip.startswith("127.") or "GLOO_SOCKET_IFNAME" in os.environ or "NCCL_SOCKET_IFNAME" in os.environ:
        return
    os.environ.update(socket_ifname_env(ip))


def _drop_conflicting_env() -> None:
    """Removes inherited AMD visibility variables the driver flagged (cluster/envcheck.py) on NVIDIA torch."""
    names = [n for n in os.environ.get("FLEETRL_UNSET_ENV", "").split(",") if n]
    if names and torch.version.hip is None:
        for n in names:
            os.environ.pop(n, None)
