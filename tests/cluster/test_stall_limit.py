"""The stall limit (first calls of a verb get cluster.first_call_stall_s while the worker answers its pings), and the
stall diagnosis's stack dumps."""
from fleetrl.cluster.watchdog import Deadlines, stall_limit, stall_reason
from fleetrl.config.schema import ClusterConfig


def test_a_later_call_uses_stall_s():
    assert stall_limit(120.0, None, answered_ago_s=0.0) == 120.0


def test_a_first_call_of_an_answering_worker_gets_the_first_call_limit():
    # answered 3 s ago (<= stall_s 120): compiling, not frozen
    assert stall_limit(120.0, 900.0, answered_ago_s=3.0) == 900.0


def test_a_first_call_of_a_silent_worker_is_a_stall_after_stall_s():
    # no answer for 121 s > stall_s: a frozen process, whatever the call
    assert stall_limit(120.0, 900.0, answered_ago_s=121.0) == 120.0


def test_a_first_call_limit_below_stall_s_never_shortens_it():
    assert stall_limit(120.0, 30.0, answered_ago_s=0.0) == 120.0


def test_the_reason_names_the_setting_that_fired():
    assert stall_reason(130.4, 120.0, 120.0) == "made no progress for 130s (cluster.stall_s=120)"
    assert stall_reason(901.0, 900.0, 120.0) == ("made no progress for 901s "
                                                 "(cluster.first_call_stall_s=900: the verb's first call)")


def test_deadlines_know_a_verb_s_first_call():
    d = Deadlines(ClusterConfig())
    assert d.first("update_actor")
    d.record("update_actor", 2.0)
    assert not d.first("update_actor") and d.first("generate")


def test_stacks_are_dumped_at_once_and_a_dead_node_is_not_waited_for(monkeypatch):
    """A stall's diagnosis dumps every worker of the call: concurrently (a frozen node costs one dump deadline,
    not one per worker on it), and not at all on a node Ray already reports dead."""
    import time

    from fleetrl.cluster import watchdog

    calls = []

    def slow_dump(info, timeout_s):
        calls.append(info["pid"])
        time.sleep(0.5)
        return watchdog.StackDump(f"stack of {info['pid']}")

    monkeypatch.setattr(watchdog, "dump_stack", slow_dump)
    monkeypatch.setattr(watchdog, "_dead_nodes", lambda: {"gone"})
    infos = [{"pid": p, "node_id": "a", "ip": "10.0.0.1"} for p in (1, 2, 3, 4)]
    infos.append({"pid": 5, "node_id": "gone", "ip": "10.0.0.2"})
    start = time.monotonic()
    out = watchdog.dump_stacks(infos)
    assert time.monotonic() - start < 1.5  # four 0.5 s dumps side by side, not 2 s in a row
    assert [d.text for d in out[:4]] == [f"stack of {p}" for p in (1, 2, 3, 4)] and sorted(calls) == [1, 2, 3, 4]
    assert out[4].text == "node 10.0.0.2 is dead (Ray reports it lost): no stack of pid 5" and not out[4].reached


def test_a_stall_names_the_nodes_its_dumps_could_not_reach(monkeypatch, tmp_path):
    """Rank 1's node is frozen (its dump task never ran): the StallError carries that node, so the supervisor waits
    for Ray to declare it dead before placing anything; rank 0's node answered and is not named."""
    from fleetrl.cluster import watchdog

    def dump(info, timeout_s):
        if info["node_id"] == "nb":
            return watchdog.StackDump("could not reach node 10.0.0.2 ...", reached=False)
        return watchdog.StackDump("Thread 1 (idle)\n    wait (gloo.py:10)\n")

    monkeypatch.setattr(watchdog, "dump_stack", dump)
    monkeypatch.setattr(watchdog, "_dead_nodes", lambda: set())
    calls = [watchdog.Call(ref=None, handle=None, pool="far", rank=r, info={"node_id": n, "ip": ip, "pid": 10 + r})
             for r, (n, ip) in enumerate([("na", "10.0.0.1"), ("nb", "10.0.0.2")])]
    err = watchdog._diagnose([calls[1]], calls, "update_critic", "made no progress for 6s (cluster.stall_s=6)", 6.0,
                             tmp_path, step=3)
    assert isinstance(err, watchdog.StallError) and err.unresponsive == {"nb": "10.0.0.2"}
    assert str(err).startswith("pool 'far' rank 1 (node 10.0.0.2, pid 11) made no progress for 6s")
    assert (tmp_path / "far_r1.txt").read_text().startswith("could not reach node 10.0.0.2")
    assert watchdog._diagnose([calls[1]], calls, "x", "why", 1.0, None, step=3).unresponsive == {}  # no dumps


# py-spy 0.4.3's dump of a SIGSTOPped Ray actor (every thread shows idle), with the watchdog's ping running beside
_STOPPED_ACTOR = """Process 21884: ray::_RayWorker.timed
Python v3.11.7 (/usr/bin/python3.11)

Thread 21884 (idle): "MainThread"
    Worker.main_loop (ray/_private/worker.py:1069)
    <module> (ray/_private/workers/default_worker.py:323)
Thread 21910 (idle): "PythonGCThread"
    Condition.wait (threading.py:327)
    PythonGCThread.run (ray/_private/gc_collect_manager.py:29)
Thread 21952 (idle)
    Worker.progress (fleetrl/workers/worker.py:62)
    FunctionActorManager._make_actor_method_executor.<locals>.actor_method_executor (ray/_private/function_manager.py:740)
Thread 21953 (idle)
    Engine.decode_step (fleetrl/engines/fast/engine.py:300)
    Engine.generate (fleetrl/engines/fast/engine.py:250)
    Worker.timed (fleetrl/workers/worker.py:57)
    FunctionActorManager._make_actor_method_executor.<locals>.actor_method_executor (ray/_private/function_manager.py:740)
"""


def test_the_top_frames_are_the_stuck_call_s_thread_not_ray_s_main_loop_or_the_ping():
    from fleetrl.cluster.watchdog import _top_frames

    assert _top_frames(_STOPPED_ACTOR) == ("Engine.decode_step (fleetrl/engines/fast/engine.py:300) | "
                                           "Engine.generate (fleetrl/engines/fast/engine.py:250) | "
                                           "Worker.timed (fleetrl/workers/worker.py:57) [Thread 21953 (idle)]")


def test_without_a_method_thread_the_active_one_is_shown():
    from fleetrl.cluster.watchdog import _top_frames

    dump = ('Thread 1 (idle): "MainThread"\n    Worker.main_loop (ray/_private/worker.py:1069)\n'
            'Thread 2 (active): "t"\n    spin (x.py:3)\n')
    assert _top_frames(dump) == "spin (x.py:3) [Thread 2 (active): \"t\"]"
