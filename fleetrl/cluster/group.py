"""WorkerGroup: the workers of one pool, as Ray actors (one per bundle) or in the driver process.

Calls are typed: pass the Worker method itself (`group.call_all(Worker.build)`), never a string. Ranks are
stable: node-bundle order of the placement group, then the worker's index on that node; rank 0 publishes
the master address for the pool's process group.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import ray
import torch
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from fleetrl import heartbeat
from fleetrl.batch import Batch, GroupPartition
from fleetrl.cluster.placement import create_pool_group
from fleetrl.cluster.store_codec import from_store, to_store
from fleetrl.cluster.telemetry import CallStats
from fleetrl.cluster.watchdog import Call, Deadlines, watch
from fleetrl.config.plan import Plan
from fleetrl.workers.context import WorkerContext
from fleetrl.workers.messages import GenerateRequest
from fleetrl.workers.rollout import cache_budget
from fleetrl.workers.worker import Worker

SERIAL = "serial"  # the rollout's concurrency group in async mode: one call at a time on the engine
# The verbs that use the rollout engine; the others (node_info, save_state, ...) must not queue behind generation.
ENGINE_VERBS = frozenset({"generate", "generate_at", "load_published", "weights_version", "bus_receive"})
# Makes one rank's actor from its context and the Ray actor options the group chose (placement, resources, env,
# concurrency). The default makes fleetrl's Worker; bench/controller_scale.py passes simulated ranks, so the real
# controller, calls and watchdog run against hundreds of ranks without models. The handle it returns answers
# `timed`, `progress` (and `.options(...)` on them) like an actor handle.
ActorFactory = Callable[[WorkerContext, dict[str, Any]], Any]


class WorkerLostError(RuntimeError):
    """A worker process or its node died; the supervisor may rebuild the groups."""


class _RayWorker(Worker):
    def __init__(self, ctx: WorkerContext) -> None:
        os.environ["FLEETRL_NODE_IP"] = ray.util.get_node_ip_address()
        os.environ["FLEETRL_NODE_ID"] = ray.get_runtime_context().get_node_id()
        super().__init__(ctx)
        self._last_end: float | None = None  # end of this worker's previous async generate call
        self._offered: tuple[list[Any], int] = ([], 0)  # the newest published weights (partial, streamed rollouts)
        self._offer_lock = threading.Lock()  # offers come from publish and from every streamed call's thread
        self._fetched: tuple[int, Any] = (0, None)  # streamed: (version, its state dict on the host, or the error)
        self._staged: dict[str, Any] | None = None  # actor rank 0: the host copy `stage_weights` made for `put_weights`
        # trainer.async_weights=bus: the staging copy `bus_offer` receives into (workers/weight_bus.py Staging), the
        # lock that keeps a receive and the loop's install of the same buffers apart, the CUDA stream the receive
        # runs on (the decode's stream never waits for it) and the event after the last install's copies
        self._staging: Any = None
        self._staging_lock = threading.Lock()
        self._bus_stream: Any = None
        self._installed: Any = None
        # trainer.stream_rollouts: one engine loop serves this worker's calls, started once `build` made the engine
        self.streaming = ctx.plan.pipeline is not None and ctx.plan.pipeline.stream and "rollout" in ctx.roles

    def build(self) -> None:
        super().build()
        if self.streaming and self.ctx.plan.pipeline.weights == "bus":
            from fleetrl.workers.weight_bus import BUCKET_BYTES

            self._allocate_staging(BUCKET_BYTES)  # before the loop starts and the first call sizes its KV cache
        if self.streaming:
            self.rollout.start_stream(self.install_newest)

    def _allocate_staging(self, bucket_bytes: int) -> None:
        """The staging copy `bus_offer` receives into, in the sender's buckets; fails naming the keys where it, or
        the KV cache after it, cannot fit."""
        from fleetrl.workers.weight_bus import Staging, receive_layout

        own, _ = receive_layout(self._need("rollout").engine_model(), self.ctx.cfg.actor.lora)
        size = sum(t.numel() * t.element_size() for _, t in own) / 2**30
        fix = ("set trainer.async_weights=store (no staging copy), or lower rollout.gpu_memory_fraction")
        try:
            with self._on_bus_stream():
                self._staging = Staging(own, bucket_bytes, self.ctx.device())
        except torch.cuda.OutOfMemoryError as err:
            raise RuntimeError(f"trainer.async_weights=bus keeps a {size:.1f} GiB staging copy of the weights on each "
                               f"rollout GPU, and it does not fit beside the engine: {fix} ({err})") from err
        budget = cache_budget(self.ctx)
        if budget is not None and self.ctx.device().type == "cuda":
            # the KV cache comes at the first call: it must still fit beside the weights and their staging copy
            free = torch.cuda.mem_get_info(self.ctx.device())[0]
            if free < budget:
                raise RuntimeError(f"trainer.async_weights=bus: after its {size:.1f} GiB staging copy of the weights "
                                   f"this rollout GPU has {free / 2**30:.1f} GiB free, below the KV-cache budget of "
                                   f"{budget / 2**30:.1f} GiB that rollout.gpu_memory_fraction="
                                   f"{self.ctx.cfg.rollout.gpu_memory_fraction} gives: {fix}")

    # -------------------------------------------- async weight path (trainer.mode=async), through the object store
    def stage_weights(self) -> None:
        """Every actor rank: the gathers of the version to publish; rank 0 keeps its host copy for `put_weights`.
        Two verbs, so the step's per-rank timings tell the gather and copy from the store's write."""
        with heartbeat.beating():  # a gather of a large model: no unit of progress to count
            self._staged = self.export_weights()

    def put_weights(self) -> list[Any]:
        """Actor rank 0: [ObjectRef] of the weights `stage_weights` copied, owned by this process; other ranks: []
        (they only joined the gathers). The list keeps Ray from resolving the ref where it is passed on."""
        staged, self._staged = self._staged, None
        if self.ctx.rank != 0:
            return []
        if staged is None:
            raise RuntimeError("put_weights on actor rank 0 before stage_weights: call stage_weights on every "
                               "actor rank first (trainer/pipeline.py publish)")
        with heartbeat.beating():  # a write of a large model into the store
            return [ray.put(to_store(staged))]  # arrays: out of band, no pickling (cluster/store_codec.py)

    def load_published(self, weights: list[Any], version: int) -> int:
        """Installs the published weights unless this engine already holds `version` (or newer); streamed, on the
        engine loop's thread while no sample runs (a load from another thread must not race its decoding)."""
        def load() -> int:
            if weights and self.weights_version() < version:
                with heartbeat.beating():  # the pull from another node's object store may outlast cluster.stall_s
                    self.install_weights(from_store(ray.get(weights[0])), version)
            elif self.streaming and self.weights_version() < version:
                self.install_newest()  # trainer.async_weights=bus: the publish left it in the staging buffers
            return self.weights_version()

        return self._need("rollout").on_engine(load)

    def bus_offer(self, bucket_bytes: int, version: int) -> int:
        """trainer.async_weights=bus: receives `version` from actor rank 0's broadcast (cluster/weight_sync.py) into
        this worker's staging copy, then offers it as `offer_weights` does. Outside the serial group and on a CUDA
        stream of its own, so it runs beside the engine loop's decoding; the loop installs it between two decode
        rounds (`install_newest`: a device-to-device copy)."""
        rollout = self._need("rollout")
        if self._staging is None:  # made at `build`; kept for the run
            self._allocate_staging(bucket_bytes)
        with self._staging_lock, self._on_bus_stream():
            with self._offer_lock:  # the buffers are about to change: nothing in them is a whole version until done
                self._fetched = (self._fetched[0], None)
            if self._installed is not None:  # the loop's copies out of the buffers are done before they refill
                torch.cuda.current_stream().wait_event(self._installed)
            views = self._staging.receive(self.bus)
            if self._bus_stream is not None:
                self._bus_stream.synchronize()  # this thread only: the loop reads the buffers once this returns
            with self._offer_lock:  # labelled before the lock goes: the loop never reads v+1's bytes as v
                if version > self._offered[1]:
                    self._offered = ([], version)
                if version > self._fetched[0]:
                    self._fetched = (version, views)
        if rollout.stream is not None:
            rollout.stream.poke(version)
        return version

    def _on_bus_stream(self) -> Any:
        device = self.ctx.device()
        if device.type != "cuda":
            return contextlib.nullcontext()
        if self._bus_stream is None:
            self._bus_stream = torch.cuda.Stream(device)
        return torch.cuda.stream(self._bus_stream)

    def offer_weights(self, weights: list[Any], version: int) -> None:
        """Partial and streamed rollouts: notes the newest published weights without installing them. It runs outside
        the serial group, so it does not wait behind the generation; that generation installs them at its next
        segment, or the engine loop between two decode rounds (`install_newest`), and later calls before they start."""
        with self._offer_lock:  # check and set together: a late offer of an older version never replaces a newer one
            if version <= self._offered[1]:
                return
            self._offered = (weights, version)  # one assignment: the serial thread reads the pair whole
        if self.streaming and self.rollout is not None and self.rollout.stream is not None:
            self.rollout.stream.poke(version)  # known to be coming: a call tagged with it waits, not fails
            # fetched beside the decoding, so the loop's install only copies (a 16 GB pull inside it would stop
            # every running sample for the transfer)
            threading.Thread(target=self._fetch, args=(weights, version), daemon=True,
                             name="fleetrl-weights-fetch").start()

    def stream_stats(self) -> dict[str, float]:
        """trainer.stream_rollouts: this worker's engine loop so far (sessions, calls, in-flight installs); {} when
        its calls are not streamed. A diagnostic the bench and tests read."""
        return dict(self.rollout.stream.stats) if self.streaming and self.rollout.stream is not None else {}

    def _fetch(self, weights: list[Any], version: int) -> None:
        try:
            state = from_store(ray.get(weights[0])) if weights else None
        except Exception as err:  # noqa: BLE001 (raised in the engine loop at its next install: its calls fail)
            state = err
        with self._offer_lock:
            if version > self._fetched[0]:
                self._fetched = (version, state)
        self.rollout.stream.poke(version)  # the loop installs it at its next round

    def install_newest(self) -> None:
        """The newest weights offered: streamed, those already fetched (never waits for a transfer in the loop);
        otherwise (partial rollouts, between segments) fetched and installed now."""
        if not self.streaming:
            weights, version = self._offered
            self.load_published(weights, version)
            return
        with self._offer_lock:
            version, state = self._fetched
        if isinstance(state, Exception):
            raise RuntimeError(f"fetching weights version {version} from the object store failed: {state}") from state
        if state is None or self.weights_version() >= version:
            return
        if self.ctx.plan.pipeline.weights == "bus":
            if not self._staging_lock.acquire(blocking=False):
                return  # a newer version is arriving into the buffers: installed at a later round, when it is whole
            try:
                with self._offer_lock:
                    version, state = self._fetched  # the newest whole one (the receive may have ended meanwhile)
                self.install_weights(state, version)
                if self.ctx.device().type == "cuda":
                    self._installed = torch.cuda.Event()
                    self._installed.record()  # the next receive waits for these copies, not the host
            finally:
                self._staging_lock.release()
        else:
            self.install_weights(state, version)
        with self._offer_lock:
            if self._fetched[0] == version:
                self._fetched = (version, None)  # installed: the host copy can go (the bus's buffers stay)

    # -------------------------------------------- policy check across pools (cluster/weight_sync.py probe_gaps)
    def put_sync_probe(self, version: int) -> list[Any]:
        """[ObjectRef] of this rollout worker's probe after the sync to `version` (the list keeps Ray from resolving
        it in the driver, which only hands it on)."""
        return [ray.put(self.sync_probe(version))]

    def score_published_probes(self, probes: list[Any]) -> list[float]:
        return self.probe_gaps(ray.get(probes))

    def generate_at(self, weights: list[Any], version: int, batch: Batch, req: GenerateRequest) -> Batch:
        """One async generate call, preceded by the load of the weights it is tagged with. The load rides in the
        call because Ray runs a concurrency group's calls one at a time but not in submission order (a call
        whose arguments arrive first runs first), so a separate load call could land after the generation."""
        start = time.perf_counter()
        try:
            if self.streaming:  # the loop installs it between decode rounds; the call waits until it holds it
                self.offer_weights(weights, version)
            else:
                self.load_published(weights, version)
            out = self.generate(batch, req)
        finally:
            gap, self._last_end = (0.0 if self._last_end is None else start - self._last_end), time.perf_counter()
        # how long this worker sat without work before the call (docs/async.md); streamed, calls overlap: the time
        # its engine loop sat with nothing to run since the previous call returned
        out.meta["rollout_idle_s"] = self.rollout.stream.take_idle_s() if self.streaming else gap
        return out


class WorkerGroup:
    def __init__(self, plan: Plan, pool_name: str, *, backend: str = "ray", env: dict[str, str] | None = None,
                 run_dir: Path | None = None, make_actor: ActorFactory | None = None) -> None:
        self.plan = plan
        self.pool = plan.pools[pool_name]
        self.backend = backend
        self.world_size = self.pool.world_size
        self.pg = None
        self.stats = CallStats(pool_name)
        self.bus_ready = False  # weight bus to a separate rollout pool connected (cluster/weight_sync.py)
        self.step = 0  # set by the controller each step: stall reports and dumps name it
        self.run_dir = run_dir
        self.make_actor = make_actor
        self.deadlines = Deadlines(plan.config.cluster)
        # Async rollout pool: calls on the engine run in a one-thread concurrency group, so one queued behind a
        # running generation waits for it instead of entering the engine beside it; `progress` pings and the
        # other verbs keep the default group.
        self.serial = plan.pipeline is not None and "rollout" in self.pool.roles and backend == "ray"
        self.infos: list[dict] = [{} for _ in range(self.world_size)]
        timeout = plan.config.cluster.init_timeout_s
        if backend == "local":
            self.workers: list[Any] = [Worker(self._ctx(0))]
        else:
            self.workers = self._spawn(env or {})
        addr, port = self._get([self._invoke(self.workers[0], Worker.master_address)], timeout)[0][0]
        self.infos = self.call_all(Worker.node_info, timeout=timeout)  # pid/node of each rank, for stall reports
        try:
            self.call_all(Worker.init_dist, addr, port, timeout, timeout=timeout)
            self.call_all(Worker.build, timeout=timeout)
        except BaseException:
            if backend == "local":  # in the driver's process: its process group must not outlive a failed build
                self.shutdown()
            raise

    def _ctx(self, rank: int) -> WorkerContext:
        return WorkerContext(plan=self.plan, pool=self.pool.name, roles=self.pool.roles, rank=rank,
                             world_size=self.world_size)

    def _spawn(self, env: dict[str, str]) -> list[Any]:
        self.pg = create_pool_group(self.pool, self.plan.config.cluster.placement_timeout_s)
        bundle = self.pool.bundle
        custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
        # trainer.stream_rollouts: the window's calls on a worker wait in its engine loop together, not in Ray's queue
        pipe = self.plan.pipeline
        width = pipe.stream_calls if pipe is not None and pipe.stream else 1
        cls = ray.remote(concurrency_groups={SERIAL: width})(_RayWorker) if self.serial else ray.remote(_RayWorker)
        workers = []
        for rank in range(self.world_size):
            node_index = rank // self.pool.bundles_per_node
            strategy = PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=node_index)
            options = dict(
                num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0), resources=custom or None,
                scheduling_strategy=strategy, runtime_env={"env_vars": dict(env)} if env else None,
                max_concurrency=2,  # one slot stays free for health pings while a long call runs
            )
            ctx = self._ctx(rank)
            workers.append(self.make_actor(ctx, options) if self.make_actor else cls.options(**options).remote(ctx))
        return workers

    # ---------------------------------------------------------------- calls
    def call_all(self, method: Callable, *args: Any, timeout: float | None = None) -> list[Any]:
        """Every rank runs `method(*args)`. `timeout` fixes the deadline (set-up calls); otherwise the watchdog's."""
        t0 = time.perf_counter()
        return self._timed_get([self._invoke(w, method, *args) for w in self.workers], method, timeout, t0,
                               sent=[a for a in args if isinstance(a, Batch)] * self.world_size)

    def call_parts(self, method: Callable, parts: Sequence[Any], *args: Any, timeout: float | None = None) -> list[Any]:
        """Rank r gets parts[r] (then the same `args` as every rank)."""
        assert len(parts) == self.world_size, (len(parts), self.world_size)
        t0 = time.perf_counter()
        return self._timed_get([self._invoke(w, method, p, *args) for w, p in zip(self.workers, parts)], method,
                               timeout, t0, sent=parts)

    def _timed_get(self, refs: list[Any], method: Callable, timeout: float | None, t0: float,
                   sent: Sequence[Any] = ()) -> list[Any]:
        """Results of Worker.timed calls; records in `stats` each rank's own seconds, the time Ray itself costs
        (call wall time - slowest worker's own compute: serialisation, scheduling, transfer) and the per-sample
        bytes sent and received (cluster/telemetry.py)."""
        verb = method.__name__
        if timeout is None and self.backend == "ray":
            pairs = self._watched(refs, verb)
        else:
            pairs = self._get(refs, timeout)
        wall = time.perf_counter() - t0
        self.deadlines.record(verb, wall)
        results = [r for r, _ in pairs]
        self.stats.record(verb, [dt for _, dt in pairs], wall, list(sent), results)
        return results

    def calls(self, refs: list[Any]) -> list[Call]:
        """The watchdog's view of one ref per rank of this group."""
        return [Call(ref=r, handle=w, pool=self.pool.name, rank=i, info=self.infos[i])
                for i, (r, w) in enumerate(zip(refs, self.workers))]

    def stall_dir(self) -> Path | None:
        return None if self.run_dir is None else self.run_dir / "stalls" / f"step_{self.step}"

    def _watched(self, refs: list[Any], verb: str) -> list[Any]:
        c = self.plan.config.cluster
        try:
            return watch(self.calls(refs), verb=verb, timeout_s=self.deadlines.of(verb), stall_s=c.stall_s,
                         stall_dir=self.stall_dir(), step=self.step,
                         first_call_stall_s=c.first_call_stall_s if self.deadlines.first(verb) else None)
        except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError) as e:
            raise WorkerLostError(f"pool '{self.pool.name}': a worker died: {e}") from e

    def call_split(self, method: Callable, batch: Batch, *args: Any, timeout: float | None = None) -> Batch:
        """Splits the batch balanced by tokens over the ranks, runs, and returns results in the input order."""
        if self.world_size == 1:
            return self.call_all(method, batch, *args, timeout=timeout)[0]
        parts, index = batch.split_balanced(self.world_size)
        return Batch.gather(self.call_parts(method, parts, *args, timeout=timeout), index)

    def call_groups(self, method: Callable, batch: Batch, partition: GroupPartition, *args: Any,
                    timeout: float | None = None) -> Batch:
        """Rank r runs `method` on its rows of the step's group partition (whole GRPO groups); the results come
        back in the batch's order. The same partition in every phase keeps each sample on one rank."""
        assert partition.world == self.world_size, (partition.world, self.world_size)
        if self.world_size == 1:
            return self.call_all(method, batch, *args, timeout=timeout)[0]
        return Batch.gather(self.call_parts(method, batch.split_groups(partition), *args, timeout=timeout),
                            partition.rows)

    def submit(self, rank: int, method: Callable, *args: Any) -> Any:
        """Starts `method(*args)` on one rank and returns its ref ((result, seconds) when done) without waiting:
        the async pipeline collects these through cluster/stream.py, under the watchdog."""
        assert self.backend == "ray", "submit is for Ray workers"
        return self._invoke(self.workers[rank], method, *args)

    def _invoke(self, worker: Any, method: Callable, *args: Any) -> Any:
        if self.backend == "local":
            return worker.timed(method.__name__, *args)
        if self.serial and method.__name__ in ENGINE_VERBS:
            return worker.timed.options(concurrency_group=SERIAL).remote(method.__name__, *args)
        return worker.timed.remote(method.__name__, *args)

    def _get(self, refs: list[Any], timeout: float) -> list[Any]:
        if self.backend == "local":
            return refs
        try:
            return _get_fail_fast(refs, timeout)
        except ray.exceptions.GetTimeoutError as e:
            raise TimeoutError(f"pool '{self.pool.name}': workers did not answer within {timeout}s "
                               f"(raise cluster.init_timeout_s if models are large)") from e
        except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError,
                ray.exceptions.NodeDiedError) as e:
            raise WorkerLostError(f"pool '{self.pool.name}': a worker died: {e}") from e

    def take_overhead(self) -> float:
        """Ray overhead accumulated since the last call (seconds), and reset."""
        return self.stats.take_overhead()

    def node_infos(self) -> list[dict]:
        return self.call_all(Worker.node_info)

    def shutdown(self) -> None:
        if self.backend == "local":
            for w in self.workers:
                w.shutdown()
            return
        for w in self.workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:  # already dead
                pass
        _kill_local_frozen(self.infos)
        if self.pg is not None:
            try:
                ray.util.remove_placement_group(self.pg)
            except Exception:
                pass


def _kill_local_frozen(infos: list[dict]) -> None:
    """ray.kill asks the worker to exit; a SIGSTOPped or hung process cannot. Workers of this group on the
    driver's node are ended by PID as well (remote ones are ended by their raylet when the actor is killed)."""
    here = ray.get_runtime_context().get_node_id()
    for info in infos:
        if info.get("node_id") == here and info.get("pid"):
            try:
                os.kill(int(info["pid"]), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _get_fail_fast(refs: list[Any], timeout: float) -> list[Any]:
    """Like ray.get(refs) with a deadline, but raises as soon as ANY call fails: when one rank dies, the others may
    block in a collective until its timeout, and ray.get would wait on them first."""
    deadline = time.monotonic() + timeout
    pending = list(refs)
    while pending:
        left = max(0.0, deadline - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not ready:
            raise ray.exceptions.GetTimeoutError(f"{len(pending)} call(s) still running")
        ray.get(ready)  # raises the worker's error now
    return ray.get(refs)
