"""Disjoint resources for the runs of a sweep on one machine: GPU sets through CUDA_VISIBLE_DEVICES, CPU cores
through `taskset` and the run's own Ray (`cluster.num_cpus`). A run that does not fit waits in the queue.

Invariant: no GPU index and no core is in two live slots at once; `Allocator.acquire` is the only way to get
one and `release` the only way to give it back.
"""
from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass

from fleetrl.config.schema import RunConfig


@dataclass(frozen=True)
class Slot:
    gpus: tuple[str, ...] = ()
    """CUDA device ids as the parent sees them (indices, or UUIDs when CUDA_VISIBLE_DEVICES holds UUIDs)."""
    cpus: tuple[int, ...] = ()
    """Cores the run is pinned to (empty = not pinned)."""

    def env(self) -> dict[str, str]:
        env = {"CUDA_VISIBLE_DEVICES": ",".join(self.gpus)}
        if self.cpus:
            # Intra-op threads beyond the run's cores only contend with the neighbouring run.
            env["OMP_NUM_THREADS"] = str(len(self.cpus))
        return env

    def command_prefix(self) -> list[str]:
        if self.cpus and shutil.which("taskset"):
            return ["taskset", "-c", ",".join(map(str, self.cpus))]
        return []

    def describe(self) -> str:
        parts = []
        if self.gpus:
            parts.append(f"gpu {','.join(self.gpus)}")
        if self.cpus:
            parts.append(f"cpu {','.join(map(str, self.cpus))}")
        return " ".join(parts) or "shared"


class Allocator:
    def __init__(self, gpus: list[str], cpus: list[int], gpus_per_run: int, cpus_per_run: int,
                 max_parallel: int) -> None:
        if gpus_per_run > len(gpus):
            raise ValueError(f"each run needs {gpus_per_run} GPU(s) but this machine shows {len(gpus)} "
                             f"({'CUDA_VISIBLE_DEVICES=' + ','.join(gpus) if gpus else 'no GPU'}); lower "
                             f"--gpus-per-run or run on a machine with more GPUs")
        if cpus_per_run > len(cpus):
            raise ValueError(f"each run asks for {cpus_per_run} CPU core(s) but this process may use "
                             f"{len(cpus)}; lower --cpus-per-run")
        self.gpus_per_run, self.cpus_per_run, self.max_parallel = gpus_per_run, cpus_per_run, max_parallel
        self.free_gpus, self.free_cpus = list(gpus), list(cpus)
        self.live: list[Slot] = []

    @property
    def capacity(self) -> int:
        """Runs that fit side by side on an idle machine."""
        fits = [self.max_parallel]
        if self.gpus_per_run:
            fits.append((len(self.free_gpus) + sum(len(s.gpus) for s in self.live)) // self.gpus_per_run)
        if self.cpus_per_run:
            fits.append((len(self.free_cpus) + sum(len(s.cpus) for s in self.live)) // self.cpus_per_run)
        return min(fits)

    def acquire(self) -> Slot | None:
        """A slot for one run, or None when the run has to wait for another to finish."""
        if len(self.live) >= self.max_parallel or len(self.free_gpus) < self.gpus_per_run \
                or len(self.free_cpus) < self.cpus_per_run:
            return None
        slot = Slot(gpus=tuple(self.free_gpus[:self.gpus_per_run]), cpus=tuple(self.free_cpus[:self.cpus_per_run]))
        del self.free_gpus[:self.gpus_per_run], self.free_cpus[:self.cpus_per_run]
        self.live.append(slot)
        return slot

    def release(self, slot: Slot) -> None:
        assert slot in self.live, f"released a slot that was not handed out: {slot}"
        self.live.remove(slot)
        # Sorted so the next run gets the lowest ids again: predictable placement in logs and tests.
        self.free_gpus = sorted(self.free_gpus + list(slot.gpus), key=_gpu_order)
        self.free_cpus = sorted(self.free_cpus + list(slot.cpus))


def _gpu_order(g: str) -> tuple[int, str]:
    return (int(g), "") if g.isdigit() else (1 << 30, g)


def detect_gpus() -> list[str]:
    """CUDA device ids this process may hand out: CUDA_VISIBLE_DEVICES when set, else nvidia-smi's list, else
    torch's count. A child's CUDA_VISIBLE_DEVICES must name devices the way the parent's does."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g.strip() for g in visible.split(",") if g.strip() and g.strip() != "-1"]
    uuids = gpu_uuids()
    if uuids:
        return [str(i) for i in range(len(uuids))]
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        return []


def gpu_uuids() -> list[str]:
    """nvidia-smi's GPU UUIDs by index (empty without nvidia-smi or a driver)."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        done = run_bounded(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"], timeout_s=30)
    except (subprocess.SubprocessError, OSError):
        return []
    return [line.strip() for line in done.stdout.splitlines() if line.strip()] if done.returncode == 0 else []


def run_bounded(cmd: list[str], *, timeout_s: float, env: dict[str, str] | None = None,
                reap_s: float = 5.0) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True) that returns within timeout_s + reap_s. On a timeout,
    subprocess.run kills the child and then waits for its pipes with no limit, and a GPU probe stuck in the driver
    (D state) outlives SIGKILL, as may a grandchild holding the pipes: the sweep's loop, which watches its runs for
    stalls, would wait with it. Here the child's process group is killed and what is still stuck is left to the OS.
    Raises subprocess.TimeoutExpired."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=reap_s)
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def detect_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def gpus_needed(cfg: RunConfig) -> int:
    """GPUs one run's placement asks for on one machine: every pool's bundles × GPUs per bundle, summed (pools
    are disjoint, e.g. a rollout pool on one GPU and the trainer on another)."""
    total = sum(p.nodes * p.workers_per_node * p.gpus_per_worker for p in cfg.cluster.pools.values())
    return math.ceil(total - 1e-9)


def cpus_needed(cfg: RunConfig) -> int:
    total = sum(p.nodes * p.workers_per_node * p.cpus_per_worker for p in cfg.cluster.pools.values())
    return max(1, math.ceil(total - 1e-9))
