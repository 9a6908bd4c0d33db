"""Weight sync to a separate rollout pool: a bus of trainer rank 0 + every rollout worker, set up once,
then one bucketed broadcast per step with a version the rollout engines check before generating."""
from __future__ import annotations

import time

import ray

from fleetrl.cluster.group import WorkerGroup
from fleetrl.cluster.watchdog import watch
from fleetrl.workers.weight_bus import BUCKET_BYTES


class WeightSyncError(RuntimeError):
    pass


def _wait(refs: list, timeout_s: float, what: str) -> list:
    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError as e:
        raise WeightSyncError(f"{what} did not finish within {timeout_s:g}s: a rollout worker is stalled or gone "
                              f"(raise cluster.init_timeout_s for very large models)") from e
    except ray.exceptions.RayTaskError as e:
        raise WeightSyncError(f"{what} failed: {e.cause if hasattr(e, 'cause') else e}") from e


def connect_bus(actor: WorkerGroup, rollout: WorkerGroup, timeout_s: float) -> None:
    host, port = ray.get(actor.workers[0].master_address.remote(), timeout=timeout_s)
    size = 1 + rollout.world_size
    refs = [w.bus_join.remote(host, port, 0 if r == 0 else -1, size, timeout_s) for r, w in enumerate(actor.workers)]
    refs += [w.bus_join.remote(host, port, 1 + r, size, timeout_s) for r, w in enumerate(rollout.workers)]
    _wait(refs, timeout_s * 2, "weight-bus rendezvous")
    actor.bus_ready = True


def broadcast_weights(actor: WorkerGroup, rollout: WorkerGroup, version: int, timeout_s: float, *,
                      beside_decode: bool = False) -> int:
    """Returns the bytes sent. Raises WeightSyncError (never hangs) when a receiver stalls. beside_decode: an async
    rollout pool receives into its staging buffers while its engine loop decodes (`bus_offer`, outside the serial
    group) instead of installing at once (`bus_receive`, synchronous mode: the engine is idle)."""
    if actor.backend == "local":
        raise WeightSyncError("a separate rollout pool needs cluster.backend=ray")
    if not actor.bus_ready:
        connect_bus(actor, rollout, timeout_s)
    verb = "bus_offer" if beside_decode else "bus_receive"
    t0 = time.perf_counter()
    # through `timed`: each rank's own seconds go to the step's metrics (rank/<pool>/bus_send, .../bus_offer)
    send = actor.calls([w.timed.remote("bus_send", BUCKET_BYTES) for w in actor.workers])
    recv = rollout.calls([w.timed.remote(verb, BUCKET_BYTES, version) for w in rollout.workers])
    try:  # the watchdog: a receiver that stops taking buckets is a stall within cluster.stall_s, named
        pairs = watch(send + recv, verb="weight_sync", timeout_s=timeout_s * 2,
                      stall_s=actor.plan.config.cluster.stall_s, stall_dir=actor.stall_dir(), step=actor.step)
    except ray.exceptions.RayTaskError as e:
        raise WeightSyncError(f"weight broadcast v{version} failed: {e.cause if hasattr(e, 'cause') else e}") from e
    wall, n = time.perf_counter() - t0, len(send)
    actor.stats.record("bus_send", [dt for _, dt in pairs[:n]], wall, [], [])
    rollout.stats.record(verb, [dt for _, dt in pairs[n:]], wall, [], [])
    return int(pairs[0][0])


def probe_gaps(actor: WorkerGroup, rollout: WorkerGroup, version: int, timeout_s: float, *,
               first: bool = False) -> list[float]:
    """The policy check across pools (engines/sync_check.py): each rollout worker samples its probe and keeps it in
    its own object store; every actor rank scores all of them (sharded ranks gather together) and rank 0's gaps come
    back, one per rollout worker. The driver holds only the probes' references. first: the run's first check (an
    engine's first generate may compile), which gets cluster.first_call_stall_s."""
    c = actor.plan.config.cluster
    watched = dict(timeout_s=timeout_s, stall_s=c.stall_s, stall_dir=actor.stall_dir(), step=actor.step,
                   first_call_stall_s=c.first_call_stall_s if first else None)
    held = watch(rollout.calls([w.put_sync_probe.remote(version) for w in rollout.workers]), verb="sync_probe",
                 **watched)
    probes = [ref for refs in held for ref in refs]
    return watch(actor.calls([w.score_published_probes.remote(probes) for w in actor.workers]), verb="sync_score",
                 **watched)[0]
