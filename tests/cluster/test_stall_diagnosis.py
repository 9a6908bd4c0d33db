"""A stall's diagnosis on real Ray processes (two raylets of ray.cluster_utils on this machine):
 - a frozen host (its raylet and every process under it SIGSTOPped) is named within cluster.stall_s plus the stack
   dump's own deadline, the message says how long the caller really waited, and the node is reported unresponsive;
 - the "top frames" are those of the thread running the stuck call, not of Ray's idle main loop."""
from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from fleetrl.cluster.watchdog import DUMP_DEADLINE_S, Call, StallError, watch

pytestmark = pytest.mark.slow

STALL_S = 3.0


@pytest.fixture(scope="module")
def two_nodes():
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"near": 1}})
    far = cluster.add_node(num_cpus=1, resources={"far": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)

    # defined here so that Ray ships the class by value (the workers need not import the tests package)
    class NoProgress:
        def where(self) -> dict:
            return {"ip": ray.util.get_node_ip_address(), "pid": os.getpid(),
                    "node_id": ray.get_runtime_context().get_node_id()}

        def progress(self) -> int:
            return 0  # never moves: a stall after STALL_S

        def work(self) -> None:
            def spin_without_progress() -> None:
                end = time.monotonic() + 120
                while time.monotonic() < end:
                    pass
            spin_without_progress()

    actor_cls = ray.remote(max_concurrency=2)(NoProgress)
    yield ray, cluster, far, actor_cls
    ray.shutdown()
    cluster.shutdown()


def _host_processes(node) -> list[psutil.Process]:
    """Every process of one ray.cluster_utils node: those it started and all their descendants."""
    procs = [psutil.Process(p.process.pid) for infos in node.all_processes.values() for p in infos]
    return procs + [c for p in procs for c in p.children(recursive=True)]


def _start(ray, actor_cls, resource: str):
    actor = actor_cls.options(resources={resource: 0.1}).remote()
    info = ray.get(actor.where.remote(), timeout=60)
    return actor, info, actor.work.remote()


def test_a_frozen_host_is_named_within_stall_s_and_the_dump_deadline(two_nodes, tmp_path):
    ray, _, far, actor_cls = two_nodes
    actor, info, ref = _start(ray, actor_cls, "far")
    frozen = _host_processes(far)
    for p in frozen:
        p.send_signal(signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(StallError) as err:
            watch([Call(ref, actor, "far", 0, info)], verb="work", timeout_s=300, stall_s=STALL_S,
                  stall_dir=tmp_path / "stalls", step=7)
        elapsed = time.monotonic() - start
    finally:
        for p in frozen:
            p.send_signal(signal.SIGCONT)
        ray.kill(actor)
    first = str(err.value).splitlines()[0]
    # stall_s, one poll, the dump deadline and slack for a loaded machine (was stall_s + 25 s: the dump's wait)
    assert elapsed < STALL_S + DUMP_DEADLINE_S + 3, (elapsed, first)
    assert f"rank 0 (node {info['ip']}, pid {info['pid']}) made no progress" in first, first
    said = int(first.split("; waited ", 1)[1].split("s", 1)[0])
    assert abs(said - elapsed) <= 1.0, (said, elapsed, first)  # what the caller waited, the dump included
    assert err.value.unresponsive == {info["node_id"]: info["ip"]}
    dump = (tmp_path / "stalls" / "far_r0.txt").read_text()
    assert f"could not reach node {info['ip']} to dump pid {info['pid']}" in dump, dump


def test_the_top_frames_are_the_busy_thread_s(two_nodes, tmp_path):
    ray, _, _, actor_cls = two_nodes
    actor, info, ref = _start(ray, actor_cls, "near")
    try:
        with pytest.raises(StallError) as err:
            watch([Call(ref, actor, "near", 0, info)], verb="work", timeout_s=300, stall_s=STALL_S,
                  stall_dir=tmp_path / "stalls", step=1)
    finally:
        ray.kill(actor)
    top = next(line for line in str(err.value).splitlines() if line.startswith("top frames of rank 0: "))
    assert "spin_without_progress" in top and "main_loop" not in top, top
    assert "Worker.main_loop" in (tmp_path / "stalls" / "near_r0.txt").read_text()  # there, but not shown
