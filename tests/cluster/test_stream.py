"""The async pipeline's Stream (cluster/stream.py) on real Ray actors: a rank whose calls all finished while the
caller waits on other refs is idle, not stuck; a rank that stops making progress inside a call still is."""
from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from fleetrl.cluster.stream import Stream
from fleetrl.cluster.watchdog import Call, Deadlines, StallError
from fleetrl.config import load_config

pytestmark = pytest.mark.slow
STALL_S = 3.0  # seconds; a loaded CI box must still answer a beating worker's pings well within it


def _worker_class(ray):
    # As the rollout workers run: calls one after another in their own group, pings answered beside them.
    @ray.remote(concurrency_groups={"calls": 1, "pings": 1}, num_cpus=0)
    class Worker:
        """Beats while a call runs (progress() moves), stands still while idle; `freeze` stops beating mid-call."""

        def __init__(self) -> None:
            self.beats = 0

        @ray.method(concurrency_group="pings")
        def progress(self) -> int:
            return self.beats

        def _busy(self, seconds: float, beat: bool = True) -> tuple[str, float]:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                self.beats += beat
                time.sleep(0.05)
            return "done", seconds

        @ray.method(concurrency_group="calls")
        def generate(self, seconds: float) -> tuple[str, float]:
            return self._busy(seconds)

        @ray.method(concurrency_group="calls")
        def load_published(self, seconds: float) -> tuple[str, float]:
            return self._busy(seconds)

        @ray.method(concurrency_group="calls")
        def freeze(self, seconds: float) -> tuple[str, float]:
            return self._busy(seconds, beat=False)

    return Worker


class _Group:
    """What Stream reads of a WorkerGroup: the plan's cluster limits, deadlines, one Call per rank, submit."""

    def __init__(self, ray, ranks: int) -> None:
        cfg = load_config("examples/quickstart.yaml", [f"cluster.stall_s={STALL_S}",
                                                       f"cluster.first_call_stall_s={STALL_S}"])
        self.plan = SimpleNamespace(config=cfg)
        self.deadlines = Deadlines(cfg.cluster)
        self.pool = SimpleNamespace(name="gen")
        self.world_size, self.step = ranks, 1
        self.workers = [_worker_class(ray).remote() for _ in range(ranks)]
        ray.get([w.progress.remote() for w in self.workers], timeout=60)  # started: pings answer from the first

    def submit(self, rank: int, method, *args):  # noqa: ANN001, ANN201
        return getattr(self.workers[rank], method.__name__).remote(*args)

    def calls(self, refs: list) -> list[Call]:
        return [Call(ref=r, handle=w, pool="gen", rank=i, info={}) for i, (r, w) in enumerate(zip(refs, self.workers))]

    def stall_dir(self) -> Path | None:
        return None


def _methods(ray):  # the worker's verbs by name, as Stream.submit reads method.__name__
    return SimpleNamespace(**{n: SimpleNamespace(__name__=n) for n in ("generate", "load_published", "freeze")})


def _wait_all(stream: Stream, refs: list) -> None:  # the pipeline's _wait_all
    left = set(refs)
    while left:
        left -= set(stream.wait(list(left)))


def test_a_rank_whose_calls_finished_uncollected_is_idle_not_stuck(ray_local):
    # load_engines's pattern: each rank has a generate running, then a load queued; the caller waits on the loads
    # only. Rank 0 finishes both at once and then idles with its generate's result uncollected, while rank 1's
    # generate runs 3 x stall_s. Rank 0's heartbeat stands still all that time: it must not be reported stuck.
    m, group = _methods(ray_local), _Group(ray_local, 2)
    stream = Stream(group)
    gens = [stream.submit(0, m.generate, 0.1), stream.submit(1, m.generate, 3 * STALL_S)]
    loads = [stream.submit(r, m.load_published, 0.1) for r in range(2)]
    _wait_all(stream, loads)
    assert set(stream.pending) == set(gens)  # both generates still uncollected; nothing was reported stuck
    _wait_all(stream, gens)
    assert not stream.pending


def test_a_rank_that_stops_beating_inside_a_call_is_still_stuck(ray_local):
    m, group = _methods(ray_local), _Group(ray_local, 2)
    stream = Stream(group)
    t0 = time.monotonic()
    refs = [stream.submit(0, m.generate, 4 * STALL_S), stream.submit(1, m.freeze, 6 * STALL_S)]
    with pytest.raises(StallError, match=r"made no progress") as err:
        _wait_all(stream, refs)
    assert "rank 1 (node" in str(err.value).splitlines()[0]  # the frozen rank is named
    assert time.monotonic() - t0 < 4 * STALL_S
