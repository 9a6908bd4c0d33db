"""The async window (trainer/schedule.py), driven by a tiny simulated controller: which weights version each step
trains on, for k = 0, 1, 2, and what hold and drop do with a slow generation. Hand-computed expectations."""
from __future__ import annotations

import pytest

from fleetrl.config.async_plan import AsyncPlan
from fleetrl.trainer.schedule import Window, staleness_bound_holds


def _plan(k: int, *, P: int = 1, G: int = 1, stale: str = "hold") -> AsyncPlan:
    return AsyncPlan(max_staleness=k, stale=stale, groups_per_step=P, chunk_groups=G, window_groups=(k + 1) * P,
                     max_chunks_per_step=P // G)


def _run(plan: AsyncPlan, steps: int, finish_order: list[int] | None = None) -> tuple[list[list[int]], list[list[int]],
                                                                                       int]:
    """Simulates `steps` steps. Chunks finish in `finish_order` (seqs; default: submission order), one at a time
    whenever the step is waiting. Returns per step the seqs trained on, their versions, and dropped groups."""
    w = Window(plan)
    version, done, order = 0, [], list(finish_order or range(1000))
    submitted = [c.seq for c in w.fill(version)]
    versions = {c.seq: c.version for c in w.outstanding.values()}
    seqs_per_step, versions_per_step = [], []
    for step in range(1, steps + 1):
        trained, taken = step - 1, []
        while len(taken) < plan.chunks_per_step:
            chunk = w.pick(done)
            while chunk is None:  # wait: the next chunk (in finish order) that was submitted finishes
                done.append(next(s for s in order if s in submitted and s not in done and s in w.outstanding))
                chunk = w.pick(done)
            done.remove(chunk.seq)
            if w.take(chunk, versions[chunk.seq], trained):
                taken.append(chunk.seq)
        seqs_per_step.append(taken)
        versions_per_step.append([versions[s] for s in taken])
        version += 1  # the step's sync publishes the next version
        for c in w.fill(version):
            submitted.append(c.seq)
            versions[c.seq] = c.version
    return seqs_per_step, versions_per_step, w.dropped_groups


@pytest.mark.parametrize("k, want", [
    # k=0: one step generated at a time, at the version it trains: the synchronous schedule.
    (0, [0, 1, 2, 3, 4]),
    # k=1: steps 1 and 2 both start at version 0 (step 2 trains version 1: staleness 1); from then on, step s
    # is submitted after step s-2's sync, at version s-2: staleness (s-1) - (s-2) = 1.
    (1, [0, 0, 1, 2, 3]),
    # k=2: steps 1-3 at version 0, then step s at version s-3 (staleness 2).
    (2, [0, 0, 0, 1, 2]),
])
def test_versions_per_step(k, want):
    _, versions, dropped = _run(_plan(k), steps=5)
    assert [v[0] for v in versions] == want and dropped == 0
    assert staleness_bound_holds(range(5), versions, k)


def test_window_holds_k_plus_one_steps():
    # P=4 groups per step in chunks of G=2, k=1: window (1+1)·4 = 8 groups = 4 chunks submitted at the start.
    w = Window(_plan(1, P=4, G=2))
    assert [c.seq for c in w.fill(0)] == [0, 1, 2, 3] and w.open_groups == 8
    assert w.fill(0) == []  # full


# Chunks of one group, two per step (P=2), k=1: four chunks (0-3) at version 0 in the window at the start.
# Chunk 0 is slow: it finishes after chunks 1, 2, 3 and 4.
SLOW_FIRST = [1, 2, 3, 4, 0, 5, 6, 7, 8, 9, 10, 11]


def test_hold_waits_for_the_slow_chunk_and_never_drops():
    seqs, versions, dropped = _run(_plan(1, P=2, stale="hold"), steps=3, finish_order=SLOW_FIRST)
    # Oldest first: step 1 waits for chunk 0. After step 1's sync (version 1) chunks 4, 5 join.
    assert seqs == [[0, 1], [2, 3], [4, 5]]
    assert versions == [[0, 0], [0, 0], [1, 1]] and dropped == 0
    assert staleness_bound_holds([0, 1, 2], versions, 1)


def test_drop_takes_what_finished_and_drops_what_grew_too_stale():
    seqs, versions, dropped = _run(_plan(1, P=2, stale="drop"), steps=3, finish_order=SLOW_FIRST)
    # Step 1 (trains v0) takes 1, 2 as they finish. Sync -> v1; window holds 0, 3: chunks 4, 5 join at v1.
    # Step 2 (trains v1) takes 3 (v0, staleness 1) and 4 (v1). Sync -> v2; window holds 0, 5: 6, 7 join at v2.
    # Step 3 (trains v2): chunk 0 finally finishes at v0: staleness 2 > 1, dropped (1 group); then 5 (v1), 6 (v2).
    assert seqs == [[1, 2], [3, 4], [5, 6]]
    assert versions == [[0, 0], [0, 1], [1, 2]] and dropped == 1
    assert staleness_bound_holds([0, 1, 2], versions, 1)


def test_hold_refuses_a_sample_beyond_the_bound():
    w = Window(_plan(1))
    chunk = w.fill(0)[0]
    with pytest.raises(AssertionError, match="staleness above max_staleness=1 under stale=hold"):
        w.take(chunk, recorded_version=0, trained_version=2)


def test_refill_only_when_the_window_is_empty():
    w = Window(_plan(0, P=2, G=2))
    chunk = w.fill(0)[0]
    assert w.refill(0) is None  # a chunk is outstanding: the step takes that first
    w.take(chunk, 0, 0)
    assert w.refill(0).seq == 1


def test_staleness_bound_check():
    assert staleness_bound_holds([3, 4], [[2, 3], [4]], 1)
    assert not staleness_bound_holds([3, 4], [[2, 3], [2]], 1)  # step 2 trained v4 on a v2 sample
