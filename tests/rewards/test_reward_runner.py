"""RewardRunner: errors, bad return values, dict returns, and timeouts that do not hang, per isolation mode."""
from __future__ import annotations

import logging
import time

import pytest

from fleetrl.rewards import RewardError, RewardRouter, RewardRunner
from fleetrl.rewards.errors import ScorerFailureError
from fleetrl.rewards.runner import _interleaved

SCORERS_FILE = """
import os
import time

def ok(response, ground_truth, extra_info):
    return float(response == ground_truth)

def boom(response, ground_truth, extra_info):
    raise ValueError("bad answer " + response)

def sleepy(response, ground_truth, extra_info):
    if response == "hang":
        time.sleep(30)
    return True

def bad_return(response, ground_truth, extra_info):
    return None if response == "none" else "1"

def with_metrics(response, ground_truth, extra_info):
    return {"score": 0.5, "length": len(response)}

def die(response, ground_truth, extra_info):
    os._exit(3)

def flaky(response, ground_truth, extra_info):
    if response == "x":
        raise ValueError("cannot score x")
    return 1.0

def hangs_on_three(response, ground_truth, extra_info):
    if ground_truth == "3":
        time.sleep(30)
    return 1.0

def forever(response, ground_truth, extra_info):
    time.sleep(3600)
"""


@pytest.fixture
def router(tmp_path):
    path = tmp_path / "scorers.py"
    path.write_text(SCORERS_FILE)
    names = ["ok", "boom", "sleepy", "bad_return", "with_metrics", "die", "flaky", "hangs_on_three", "forever"]
    return RewardRouter({name: f"{path}:{name}" for name in names})


def score(runner: RewardRunner, sources: list[str], responses: list[str]):
    return runner.score(responses, ["a"] * len(responses), sources, [{}] * len(responses))


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_errors_and_return_values(router, isolation, caplog):
    with RewardRunner(router, isolation=isolation, default_score=-1.0, num_workers=2) as runner:
        with caplog.at_level(logging.WARNING, logger="fleetrl.rewards"):
            result = score(runner, ["ok", "ok", "boom", "boom", "bad_return", "bad_return", "with_metrics", "sleepy"],
                           ["a", "b", "x", "y", "none", "s", "abc", "fast"])
    assert result.scores == [1.0, 0.0, -1.0, -1.0, -1.0, -1.0, 0.5, 1.0]
    assert (result.num_errors, result.num_timeouts) == (4, 0)
    assert result.extras[6] == {"length": 3} and result.extras[0] == {}
    assert "ValueError: bad answer x" in result.errors[0] and "sample 2" in result.errors[0]
    assert "NoneType" in result.errors[2] and "str '1'" in result.errors[3]
    logged = [r.getMessage() for r in caplog.records if r.name == "fleetrl.rewards"]
    assert len(logged) == 2  # once for boom, once for bad_return, though each failed twice


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_timeout_does_not_hang_or_starve_later_calls(router, isolation):
    with RewardRunner(router, isolation=isolation, timeout_s=0.5, num_workers=1) as runner:
        score(runner, ["ok"], ["a"])  # start the worker before timing
        start = time.monotonic()
        result = score(runner, ["sleepy", "sleepy", "ok"], ["hang", "fast", "a"])
        elapsed = time.monotonic() - start
        assert elapsed < 5.0, f"a stuck scorer stalled the runner for {elapsed:.1f}s"
        assert result.scores == [0.0, 1.0, 1.0] and (result.num_timeouts, result.num_errors) == (1, 0)
        assert "no result within 0.5s" in result.errors[0]
        assert score(runner, ["ok"], ["a"]).scores == [1.0]  # the replacement worker keeps serving
    assert runner.num_abandoned_threads == (1 if isolation == "thread" else 0)


def test_process_worker_that_dies_is_counted_and_replaced(router):
    with RewardRunner(router, isolation="process", num_workers=1) as runner:
        result = score(runner, ["die", "ok"], ["x", "a"])
    assert result.scores == [0.0, 1.0] and result.num_errors == 1 and "worker died" in result.errors[0]


def test_unknown_source_and_bad_settings(router):
    runner = RewardRunner(router)
    with pytest.raises(RewardError, match="no reward scorer for data_source 'trivia'"):
        score(runner, ["trivia"], ["a"])
    with pytest.raises(RewardError, match="isolation"):
        RewardRunner(router, isolation="fiber")
    assert score(runner, [], []).scores == []


TIMEOUT_S = 1.5  # long enough that spawning 4 worker processes on a loaded 2-core machine is not a timeout


def test_scorer_that_never_returns_stops_the_run_naming_it_within_bounded_time(router):
    # 16 samples, 4 workers, timeout T = 1.5 s. Without the hung-scorer rule this costs 16 / 4 × T = 4T; with it
    # the first round of 4 timeouts (≥ HUNG_AFTER = 3 in a row) marks the scorer hung and the other 12 are not
    # run: 16 failed of 16 > 0.5 × 16, so the batch raises after ~T.
    with RewardRunner(router, timeout_s=TIMEOUT_S, num_workers=4, max_failure_rate=0.5) as runner:
        start = time.monotonic()
        with pytest.raises(ScorerFailureError, match=r"scorer '.*scorers.py:forever' \(data_source forever\) failed "
                                                    r"on 16 of 16 samples.*max_failure_rate=0.5") as err:
            score(runner, ["forever"] * 16, ["a"] * 16)
        elapsed = time.monotonic() - start
    assert elapsed < 3 * TIMEOUT_S, f"a hung scorer cost {elapsed:.1f}s for one batch"
    assert "4 timeouts, 12 not run" in str(err.value)


@pytest.mark.slow  # waits out scoring timeouts
def test_hung_scorer_without_a_rate_limit_is_isolated_and_counted_each_batch(router):
    # max_failure_rate=1 (never stop): each batch still costs one round of timeouts, the good scorer's samples
    # still score, and after the first timeout (isolation=auto) the workers are processes that get killed.
    with RewardRunner(router, timeout_s=TIMEOUT_S, num_workers=4) as runner:
        for batch in range(2):
            start = time.monotonic()
            result = score(runner, ["forever"] * 12 + ["ok"] * 4, ["a"] * 16)
            elapsed = time.monotonic() - start
            assert elapsed < 3 * TIMEOUT_S, f"batch {batch}: a hung scorer cost {elapsed:.1f}s"
            assert result.scores == [0.0] * 12 + [1.0] * 4
            assert result.num_timeouts + result.num_skipped == 12 and result.num_timeouts >= 3
            assert result.failed_by_scorer == {runner.router.spec_for("forever"): 12}
        # Only the first round ran on threads (abandoned); the second batch's timed-out processes were killed.
        assert runner.num_abandoned_threads <= 4 and runner._ctx is not None


def test_failure_rate_counts_errors_per_scorer(router):
    # boom fails 2 of 2 (> 0.5 × 2) while ok succeeds: the error names boom only.
    with RewardRunner(router, max_failure_rate=0.5, isolation="thread") as runner:
        with pytest.raises(ScorerFailureError, match=r"scorers.py:boom' \(data_source boom\) failed on 2 of 2") as err:
            score(runner, ["boom", "ok", "boom", "ok"], ["x", "a", "y", "a"])
        assert "scorers.py:ok'" not in str(err.value).split("First failure")[0]
        # flaky fails 1 of 2, not above 0.5 × 2 = 1: scored, not raised.
        result = score(runner, ["flaky", "ok", "flaky"], ["x", "a", "y"])
        assert result.scores == [0.0, 1.0, 1.0] and result.num_errors == 1
    with pytest.raises(RewardError, match="max_failure_rate must be in"):
        RewardRunner(router, max_failure_rate=1.5)


@pytest.mark.slow  # waits out scoring timeouts
def test_a_scorer_that_hangs_only_on_some_inputs_is_not_declared_hung(router):
    # One worker, so calls run in order. "sleepy" hangs on "hang". Timeout streaks: 1, 2, reset by "fast", 1, 2,
    # reset: never 3 in a row, so every sample runs (4 timeouts, 0 skipped).
    with RewardRunner(router, timeout_s=0.6, num_workers=1, isolation="process") as runner:
        result = score(runner, ["sleepy"] * 6, ["hang", "hang", "fast", "hang", "hang", "fast"])
        assert (result.num_timeouts, result.num_skipped) == (4, 0) and result.scores[2] == result.scores[5] == 1.0
        # Three in a row (streak 3) marks it hung: the "fast" sample after them is not run.
        result = score(runner, ["sleepy"] * 4, ["hang", "hang", "hang", "fast"])
        assert (result.num_timeouts, result.num_skipped) == (3, 1)
        assert "timed out on 3 calls in a row" in result.errors[3]


def test_interleaved_order_spreads_each_prompts_samples():
    # keys a a a b b c -> occurrence ranks 0 1 2 0 1 0 -> sorted by (rank, index): 0 3 5 1 4 2
    assert _interleaved(["a", "a", "a", "b", "b", "c"]) == [0, 3, 5, 1, 4, 2]


def test_one_prompt_that_hangs_does_not_mark_the_scorer_hung(router):
    # GRPO batches hold each prompt's n samples together: here 8 samples of ground truth "3" (the scorer hangs on
    # them) then 8 of other prompts. Interleaved order: 0, 8..15, 1..7, so the first round holds one "3" sample and
    # the other prompts all score. Only then do the "3" samples fill the workers, string 3 timeouts together and
    # get the rest of theirs skipped: every one of the 8 fails either way, and no other prompt's sample does.
    truths = ["3"] * 8 + ["1", "2", "4", "5", "6", "7", "8", "9"]
    with RewardRunner(router, timeout_s=0.8, num_workers=4, isolation="process") as runner:
        result = runner.score(["x"] * 16, truths, ["hangs_on_three"] * 16, [{}] * 16)
    assert result.scores == [0.0] * 8 + [1.0] * 8
    assert result.num_timeouts + result.num_skipped == 8 and result.num_timeouts >= 3
