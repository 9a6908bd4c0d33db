"""The per-step memory peaks a worker reports (workers/memory.py), against allocations of known size."""
from __future__ import annotations

import resource
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fleetrl.workers import memory
from fleetrl.workers.memory import GPU_ALLOCATED, GPU_RESERVED, RSS, memory_peaks, rss_peak_gib

MIB_256 = 2**28  # bytes: 0.25 GiB
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM and clear_refs are Linux's")


def _rss_now_gib() -> float:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 2**20  # kB


def test_cpu_reports_only_the_rss_peak_as_a_max():
    peaks = memory_peaks(torch.device("cpu"))
    assert set(peaks) == {RSS} and peaks[RSS].op == "max"
    assert peaks[RSS].value >= 0.01  # a Python process with torch loaded holds far more than 10 MiB


@linux
def test_rss_peak_sees_a_freed_allocation_and_the_read_resets_it():
    rss_peak_gib()  # reset: the peak is now the current RSS
    before = _rss_now_gib()
    block = np.ones(MIB_256 // 8)  # 0.25 GiB of float64, every page written
    del block  # an mmap'd block: freed back to the kernel, so only the peak remembers it
    peak = rss_peak_gib()
    assert peak >= before + 0.2
    # reset by the previous read: the block is gone from the new window's peak
    assert rss_peak_gib() <= peak - 0.15


def test_without_vmhwm_it_falls_back_to_the_lifetime_peak(monkeypatch):
    def missing() -> int:
        raise OSError("no /proc")

    monkeypatch.setattr(memory, "_vm_hwm_kib", missing)
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux: KiB
    assert rss_peak_gib() == pytest.approx(kib / 2**20, rel=0.05)


@pytest.mark.gpu
def test_gpu_peaks_count_a_freed_tensor_and_reset():
    device = torch.device("cuda", 0)
    memory_peaks(device)
    allocated0 = torch.cuda.memory_allocated(device) / 2**30
    block = torch.ones(MIB_256 // 4, device=device)  # 0.25 GiB of float32
    del block
    peaks = memory_peaks(device)
    assert set(peaks) == {RSS, GPU_ALLOCATED, GPU_RESERVED}
    assert peaks[GPU_ALLOCATED].value >= allocated0 + 0.25
    # reserved is what the allocator holds from the driver: at least what it handed to tensors
    assert peaks[GPU_RESERVED].value >= peaks[GPU_ALLOCATED].value
    assert memory_peaks(device)[GPU_ALLOCATED].value <= allocated0 + 0.01  # the 0.25 GiB is not in the new window


def test_onednn_caches_are_bounded_unless_the_environment_names_a_capacity(monkeypatch):
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "")  # so that the test's teardown restores the variable
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "1024")  # named by the user (cluster.env): kept
    set_now = memory.bound_onednn_caches(64)
    assert set_now == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64"}
    assert memory.os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "64"
    assert memory.os.environ["LRU_CACHE_CAPACITY"] == "1024"
    assert memory.bound_onednn_caches(64) == {}  # both named now: nothing to set
