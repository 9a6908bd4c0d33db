"""The reaper of a driver's local Ray (fleetrl/cluster/reaper.py): after a SIGKILL of the driver, nothing of its Ray
is left (Ray 2.60 leaves the raylet's DashboardAgent and RuntimeEnvAgent running), and only processes of that one
Ray node are ever touched."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from fleetrl.cluster import reaper

REPO = Path(__file__).resolve().parents[2]

DRIVER = """
import sys, time
import ray
from fleetrl.cluster.runtime import ensure_ray
from fleetrl.config.schema import ClusterConfig
ensure_ray(ClusterConfig(num_cpus=1))
print(ray.get_runtime_context().get_node_id(), flush=True)
time.sleep(600)
"""


def _alive(procs: dict[int, float]) -> set[str]:
    """Titles of the processes (pid -> create time) still alive: Ray's titles, padded; name() cuts them at 15."""
    titles = set()
    for pid, created in procs.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                titles.add(" ".join(p.cmdline()).strip()[:60])
        except psutil.Error:
            pass
    return titles


@pytest.mark.slow
def test_a_killed_driver_leaves_no_ray_process_behind():
    tmp = tempfile.mkdtemp(prefix="frr", dir="/tmp")  # short: Ray's socket paths live under it
    env = {**os.environ, "PYTHONPATH": str(REPO), "FLEETRL_RAY_TMPDIR": tmp, "RAY_USAGE_STATS_ENABLED": "0"}
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], env=env, stdout=subprocess.PIPE, text=True,
                              stderr=subprocess.DEVNULL)
    ray_procs: dict[int, float] = {}  # everything the driver started: its Ray, down to the raylet's agents
    try:
        assert driver.stdout.readline().strip(), "the driver did not start Ray"
        deadline = time.monotonic() + 30  # the raylet starts its agents a moment after ray.init returns
        while not {"ray::DashboardAgent", "ray::RuntimeEnvAgent"} <= _alive(ray_procs):
            assert time.monotonic() < deadline, _alive(ray_procs)
            ray_procs.update({p.pid: p.create_time() for p in psutil.Process(driver.pid).children(recursive=True)})
            time.sleep(0.2)
        driver.kill()
        driver.wait(timeout=10)
        killed_at = time.monotonic()
        while _alive(ray_procs) and time.monotonic() < killed_at + reaper.GRACE_S + 10:
            time.sleep(0.2)
        assert not _alive(ray_procs), _alive(ray_procs)
    finally:
        if driver.poll() is None:
            driver.kill()
        for pid, created in ray_procs.items():  # what this test started, whatever the outcome
            with contextlib.suppress(psutil.Error):
                if psutil.Process(pid).create_time() == created:
                    psutil.Process(pid).kill()
        shutil.rmtree(tmp, ignore_errors=True)


def test_only_the_node_s_processes_are_reaped():
    """Two sleeping processes, one with the node's RAY_NODE_ID and one with another node's: only the first goes."""
    ours = subprocess.Popen(["sleep", "60"], env={**os.environ, "RAY_NODE_ID": "aa11"})
    other = subprocess.Popen(["sleep", "60"], env={**os.environ, "RAY_NODE_ID": "bb22"})
    try:
        assert [pid for pid, _ in reaper.node_processes("aa11")] == [ours.pid]
        assert reaper.reap("aa11", [], grace_s=0.0) == [ours.pid]
        assert ours.wait(timeout=5) == -signal.SIGKILL
        assert other.poll() is None
    finally:
        for p in (ours, other):
            p.kill()
            p.wait()
