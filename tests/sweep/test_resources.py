import os
import subprocess
import time

import psutil
import pytest

from fleetrl.config import load_config
from fleetrl.sweep.resources import Allocator, Slot, cpus_needed, gpus_needed, run_bounded


def test_gpu_slots_are_disjoint_and_runs_queue_when_short():
    alloc = Allocator(gpus=["0", "1", "2", "3", "4"], cpus=[0, 1], gpus_per_run=2, cpus_per_run=0, max_parallel=8)
    a, b = alloc.acquire(), alloc.acquire()
    # 5 GPUs / 2 per run = 2 runs; the fifth GPU is not enough for a third.
    assert a.gpus == ("0", "1") and b.gpus == ("2", "3")
    assert alloc.acquire() is None
    assert alloc.capacity == 2
    alloc.release(a)
    c = alloc.acquire()
    assert c.gpus == ("0", "1") and not set(c.gpus) & set(b.gpus)
    assert c.env()["CUDA_VISIBLE_DEVICES"] == "0,1" and "OMP_NUM_THREADS" not in c.env()


def test_cpu_slots_pin_cores_and_respect_max_parallel():
    alloc = Allocator(gpus=[], cpus=[0, 1, 2, 3, 4, 5], gpus_per_run=0, cpus_per_run=2, max_parallel=2)
    a, b = alloc.acquire(), alloc.acquire()
    assert a.cpus == (0, 1) and b.cpus == (2, 3)
    assert alloc.acquire() is None  # cores 4,5 are free but max_parallel=2
    assert a.env() == {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "2"}
    assert a.command_prefix()[-2:] == ["-c", "0,1"]
    alloc.release(b)
    alloc.release(a)
    assert alloc.free_cpus == [0, 1, 2, 3, 4, 5]


def test_releasing_an_unknown_slot_is_a_bug():
    alloc = Allocator(gpus=[], cpus=[0], gpus_per_run=0, cpus_per_run=1, max_parallel=1)
    with pytest.raises(AssertionError, match="not handed out"):
        alloc.release(Slot(cpus=(0,)))


def test_a_run_bigger_than_the_machine_is_an_error():
    with pytest.raises(ValueError, match="needs 4 GPU.*shows 2 .*lower --gpus-per-run"):
        Allocator(gpus=["0", "1"], cpus=[0], gpus_per_run=4, cpus_per_run=0, max_parallel=1)
    with pytest.raises(ValueError, match="asks for 3 CPU core.*may use 2"):
        Allocator(gpus=[], cpus=[0, 1], gpus_per_run=0, cpus_per_run=3, max_parallel=1)


def test_placement_needs():
    cfg = load_config("examples/quickstart.yaml", ["cluster.pools.main.gpus_per_worker=1",
                                                   "cluster.pools.main.workers_per_node=2"])
    # one pool: 1 node x 2 workers x 1 GPU = 2 GPUs; 2 workers x 1 CPU (quickstart's cpus_per_worker) = 2 CPUs
    assert gpus_needed(cfg) == 2 and cpus_needed(cfg) == 2
    assert gpus_needed(load_config("examples/quickstart.yaml", [])) == 0


def test_run_bounded_returns_even_when_a_process_holds_its_pipes_past_the_kill():
    # The grandchild leaves the group (setsid) and keeps the pipes open, as a probe stuck in the GPU driver outlives
    # SIGKILL: subprocess.run(timeout=...) would then wait for the pipes for 60 s. run_bounded gives up after reap_s.
    marker = f"sleep {60 + os.getpid() % 1000 / 1000:.3f}"  # a unique command line, to end only our own process
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_bounded(["sh", "-c", f"setsid {marker} & sleep 60"], timeout_s=0.5, reap_s=1.0)
    assert time.monotonic() - t0 < 5
    for proc in psutil.process_iter(["cmdline"]):
        if " ".join(proc.info["cmdline"] or []) == marker:
            proc.kill()


def test_run_bounded_returns_the_output():
    done = run_bounded(["sh", "-c", "echo out; echo err >&2; exit 3"], timeout_s=10)
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")
