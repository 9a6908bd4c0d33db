"""bench/chaos.py, short: every fault kind once in a 40-step PPO run on two network-namespace hosts; the run ends
with rc 0, bit-identical final weights to the uninterrupted reference, every rewritten step superseded, and nothing
left behind. The schedule's own helpers are checked without Ray."""
from __future__ import annotations

import pytest

from bench.chaos import KINDS, schedule, soak, unmarked_rewrites
from tests import netns

REASON = netns.skip_reason()


def test_schedule_is_seeded_spread_and_covers_every_kind():
    a, b = schedule(3, 20, 200, KINDS), schedule(3, 20, 200, KINDS)
    assert a == b and a != schedule(4, 20, 200, KINDS)
    steps = [f.step for f in a]
    assert steps == sorted(steps) and len(set(steps)) == 20 and 4 <= steps[0] and steps[-1] <= 196
    assert {f.kind for f in a} == set(KINDS)


def test_rewrites_must_follow_a_resumed_event_that_supersedes_them():
    train = [{"step": s, "train/reward_mean": 0.0} for s in (1, 2, 3)]
    resumed = {"event": "resumed", "supersedes_after": 2}
    assert unmarked_rewrites([*train, resumed, {"step": 3, "train/reward_mean": 0.0}]) == []
    assert unmarked_rewrites([*train, {"step": 3, "train/reward_mean": 0.0}]) == [3]
    assert unmarked_rewrites([*train, {**resumed, "supersedes_after": 3}, {"step": 3, "train/reward_mean": 0}]) == [3]


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.timeout(900)  # the soak's own deadline: 366 s beside the rest of CI's slow tests (2026-11-27), >300
@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_short_soak_survives_every_fault_kind_bit_identically():
    result = soak(seed=7, n_faults=len(KINDS), steps=40, save_every=4, kinds=KINDS, timeout_s=900)
    assert result["passed"], {k: v for k, v in result.items() if k != "table"}
    assert not result["weight_diffs"] and not result["leftovers"] and result["rc"] == 0
