"""Peak memory of this worker process between two reports: what the trainer logs per step as `train/memory/*`.

Peaks, not current usage: a step's high-water mark (the rollout's KV cache, the update's activations) decides
whether a larger batch fits, and it is gone by the time the step ends. Every read resets the peaks, so each
report covers what the process did since the previous one. They are `Extreme`s ("max"): the controller keeps
the largest over ranks and over the pools that report (workers/messages.py:UpdateMetrics.reduce_roles).
"""
from __future__ import annotations

import os
import resource
import sys
from pathlib import Path

import torch

from fleetrl.workers.messages import Extreme

GIB = float(2**30)
RSS = "memory/rss_peak_gib"
GPU_ALLOCATED = "memory/gpu_peak_allocated_gib"
GPU_RESERVED = "memory/gpu_peak_reserved_gib"

# How many compiled matmul/convolution primitives oneDNN keeps, in each of its two caches: oneDNN's own primitive
# cache and ideep's (the C++ layer between torch and oneDNN). Why bounded: torch runs CPU bf16 matmuls (the bf16
# decode, the bf16-autocast update) through oneDNN, which compiles and caches one primitive per distinct shape, and
# an RL step's shapes are new most steps (prompt + response token counts of prefills and packed rows). At the
# default of 1024 entries in each (~0.35-0.7 MiB an entry for SmolLM2's projections) that is up to ~1 GiB, the climb
# the SmolLM2 LoRA job showed over its first ~50 steps, and once full their evictions fragment glibc's arenas
# (bench/RESULTS.md, "RSS over a whole run").
# 64 still holds what repeats within a step: one micro-batch's forward + backward shapes (the 30 layers share them)
# and the decode's. fp32 CPU matmuls (an AVX2-only CPU's precision under `auto`) do not go through these caches.
ONEDNN_CACHE_CAPACITY = 64
ONEDNN_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def memory_peaks(device: torch.device) -> dict[str, Extreme]:
    """This process's peak memory in GiB since the previous call (or the process start), then resets the peaks:
    always the resident set size; on a CUDA device also the peak its caching allocator handed to tensors
    (`allocated`) and held from the driver (`reserved`, what other processes on the GPU cannot use)."""
    peaks = {RSS: Extreme(rss_peak_gib(), "max")}
    if device.type == "cuda":
        peaks[GPU_ALLOCATED] = Extreme(torch.cuda.max_memory_allocated(device) / GIB, "max")
        peaks[GPU_RESERVED] = Extreme(torch.cuda.max_memory_reserved(device) / GIB, "max")
        if torch.cuda.is_initialized():  # before CUDA's first use the peaks are 0 and a reset raises
            torch.cuda.reset_peak_memory_stats(device)
    return peaks


def bound_onednn_caches(capacity: int = ONEDNN_CACHE_CAPACITY) -> dict[str, str]:
    """Caps oneDNN's and ideep's primitive caches of this process at `capacity` entries each, unless the
    environment already names a capacity (cluster.env may). Returns the variables it set. Both libraries read the
    variable once, at their first primitive: call before the process's first bf16 matmul (Worker.build)."""
    set_now = {k: str(capacity) for k in ONEDNN_CACHE_VARIABLES if not os.environ.get(k)}
    os.environ.update(set_now)
    return set_now


def rss_peak_gib() -> float:
    """Peak resident set size since the previous call: Linux's VmHWM, reset to the current RSS by writing 5 to
    /proc/self/clear_refs (Documentation/filesystems/proc.rst, "clear_refs")."""
    try:
        peak_kib = _vm_hwm_kib()
        Path("/proc/self/clear_refs").write_text("5")
    except (OSError, ValueError):
        # Not Linux, or a kernel / sandbox that refuses the reset: the peak over the process's whole life, which
        # getrusage reports and nothing resets; still an upper bound of this step's peak.
        return _ru_maxrss_gib()
    return peak_kib * 1024 / GIB


def _vm_hwm_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])  # "VmHWM:   123456 kB"
    raise ValueError("no VmHWM line in /proc/self/status")


def _ru_maxrss_gib() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # bytes on macOS, KiB on Linux and the BSDs
    return peak / GIB if sys.platform == "darwin" else peak * 1024 / GIB
