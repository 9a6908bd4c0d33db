"""RewardRunner: errors, bad return values, dict returns, and timeouts that do not hang, per isolation mode."""
from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import struct
import time

import pytest

from fleetrl.rewards import RewardError, RewardRouter, RewardRunner
from fleetrl.rewards import runner as runner_module
from fleetrl.rewards.errors import ScorerFailureError
from fleetrl.rewards.runner import _batch_size, _interleaved
from fleetrl.rewards.workers import Claims, RewardWorker, bound_pipe_io

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

def nap(response, ground_truth, extra_info):
    time.sleep(float(response))
    if "log" in extra_info:  # finishing order, one ground truth a line
        with open(extra_info["log"], "a") as f:
            f.write(ground_truth + "\\n")
    return 1.0
"""


@pytest.fixture
def router(tmp_path):
    path = tmp_path / "scorers.py"
    path.write_text(SCORERS_FILE)
    names = ["ok", "boom", "sleepy", "bad_return", "with_metrics", "die", "flaky", "hangs_on_three", "forever", "nap"]
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
    # The first round's 4 calls were sent in one dispatch pass, which gives them one clock: they time out
    # together (4 + 12), however the runner thread was scheduled between the sends.
    assert "4 timeouts, 12 not run" in str(err.value), str(err.value)


def test_calls_sent_together_time_out_together_however_the_runner_is_scheduled(router, monkeypatch):
    # A loaded machine, made deterministic: the runner thread loses the CPU for 50 ms right after the first send of
    # a pass. The pass's 4 `forever` calls still share one clock, so they time out together and mark the scorer
    # hung at once: 4 timeouts, the other 4 `forever` samples not run, the `ok` ones scored. (With a clock per
    # send the first call timed out alone, the next pass started a 5th `forever` call before the other three
    # timed out, and it ran out its own timeout: 5 timeouts, 3 not run, one round of timeout_s more.)
    send, sends = RewardRunner._send, []

    def preempted_send(self, st, worker, batch):
        send(self, st, worker, batch)
        sends.append(batch)
        if len(sends) == 1:
            time.sleep(0.05)

    monkeypatch.setattr(RewardRunner, "_send", preempted_send)
    with RewardRunner(router, isolation="thread", timeout_s=0.5, num_workers=4) as runner:
        result = score(runner, ["forever"] * 8 + ["ok"] * 4, ["a"] * 12)
    assert (result.num_timeouts, result.num_skipped, result.num_errors) == (4, 4, 0)
    assert result.scores == [0.0] * 8 + [1.0] * 4 and sends[:4] == [[0], [1], [2], [3]]


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


# ------------------------------------------------------------------------------- batches of calls per worker
@pytest.fixture
def batched(monkeypatch):
    """Small passes batched too (by default they go one call per message): each worker's share of the pass is one
    batch, so the tests below can tell which calls share a batch."""
    monkeypatch.setattr(runner_module, "MIN_BATCHES_PER_WORKER", 1)


def test_batch_size_is_bounded_by_the_pass_and_the_workers():
    # min(16, n // (4 × workers)), at least 1: one call per message below 8 × workers samples.
    assert [_batch_size(n, 4) for n in (16, 31, 32, 64, 256, 1000)] == [1, 1, 2, 4, 16, 16]
    assert _batch_size(5, 1) == 1 and _batch_size(8, 1) == 2


@pytest.mark.parametrize("ctx", [None, "spawn"])
def test_claims_tell_the_runner_exactly_which_calls_were_not_started(ctx):
    claims = Claims(None if ctx is None else multiprocessing.get_context(ctx))
    first = claims.begin(3)
    assert claims.take(first) and claims.take(first)  # the worker starts two of three
    assert claims.cut() == 2  # the runner takes the third back...
    assert not claims.take(first)  # ...and the worker can no longer start it
    second = claims.begin(2)
    assert not claims.take(first)  # a worker still leaving batch 1 cannot take batch 2's claims
    assert claims.take(second) and claims.take(second) and not claims.take(second)
    assert claims.cut() == 2  # all started: nothing to take back


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_call_that_hangs_in_the_middle_of_a_batch_times_out_alone(router, isolation, batched):
    # One worker, so the 5 samples go to it as one batch; the third hangs. Only it times out: the two before it
    # answered, the two after it go back to the queue and score on the replacement worker.
    with RewardRunner(router, isolation=isolation, timeout_s=0.5, num_workers=1) as runner:
        score(runner, ["ok"], ["a"])  # start the worker before timing
        start = time.monotonic()
        result = score(runner, ["sleepy"] * 5, ["fast", "fast", "hang", "fast", "fast"])
        elapsed = time.monotonic() - start
    assert result.scores == [1.0, 1.0, 0.0, 1.0, 1.0]
    assert (result.num_timeouts, result.num_errors, result.num_skipped) == (1, 0, 0)
    assert "sample 2" in result.errors[0] and "no result within 0.5s" in result.errors[0]
    assert elapsed < 5.0


def test_timeout_s_limits_each_call_of_a_batch_not_the_batch(router, batched):
    # 4 calls of 0.3 s in one batch take 1.2 s, more than timeout_s = 0.9, but each call is well within it (0.6 s
    # to spare for the worker thread's wake-up and reply on a loaded machine; 0.5 left only 0.2 s).
    with RewardRunner(router, isolation="thread", timeout_s=0.9, num_workers=1) as runner:
        start = time.monotonic()
        result = score(runner, ["nap"] * 4, ["0.3"] * 4)
        elapsed = time.monotonic() - start
    assert result.scores == [1.0] * 4 and result.num_timeouts == 0
    assert elapsed >= 1.2


def test_an_idle_worker_takes_over_the_calls_stuck_behind_a_slow_one(router, tmp_path, batched):
    # Distinct ground truths keep the order 0..7, so with 2 workers the batches are [0 1 2 3] and [4 5 6 7].
    # Sample 1 naps 1 s; 4..7 nap 0.05 s each, so the second worker is idle at ~0.2 s while the first is inside
    # sample 1: it takes over samples 2 and 3, which finish before 1 instead of after it.
    log = tmp_path / "finished.txt"
    naps = ["0", "1.0", "0", "0", "0.05", "0.05", "0.05", "0.05"]
    with RewardRunner(router, isolation="thread", timeout_s=5.0, num_workers=2) as runner:
        result = runner.score(naps, [str(i) for i in range(8)], ["nap"] * 8, [{"log": str(log)}] * 8)
    assert result.scores == [1.0] * 8
    finished = log.read_text().split()
    assert finished[-1] == "1" and sorted(finished) == [str(i) for i in range(8)]


@pytest.mark.parametrize("isolation", ["thread", "auto"])
def test_a_hung_scorers_calls_waiting_in_another_workers_batch_are_not_run(router, isolation, batched):
    # 16 samples with distinct ground truths, 4 workers: batches [0..3] [4..7] [8..11] [12..15]. The first three
    # batches call `forever`. The fourth naps 0.75 s (12) then 1.2 s (13), so at the timeout (1.5 s) it is inside
    # 13, with 14 (`forever`) and 15 (a nap) not started. The three timeouts in a row (0, 4, 8) mark `forever`
    # hung: the 9 calls behind them and 14, taken back from the busy fourth worker, are skipped, never run (run,
    # 14 would be a 4th timeout); 15 is queued again and scores. (auto: the first timeout moves work to
    # processes, taking back the unstarted calls of the busy threads first; same outcome.)
    sources = ["forever"] * 12 + ["nap", "nap", "forever", "nap"]
    responses = ["x"] * 12 + ["0.75", "1.2", "x", "0"]
    with RewardRunner(router, isolation=isolation, timeout_s=TIMEOUT_S, num_workers=4) as runner:
        result = runner.score(responses, [str(i) for i in range(16)], sources, [{}] * 16)
    assert result.scores == [0.0] * 12 + [1.0, 1.0, 0.0, 1.0]
    assert (result.num_timeouts, result.num_skipped, result.num_errors) == (3, 10, 0)
    assert "sample 1 " in result.errors[1] and "timed out on 3 calls in a row" in result.errors[1]


def test_a_sample_that_cannot_be_sent_fails_alone(router, batched):
    extras = [{}, {"f": lambda: None}, {}]  # a lambda does not pickle: the batch of 3 cannot be sent as is
    with RewardRunner(router, isolation="thread", default_score=-1.0, num_workers=1) as runner:
        result = runner.score(["a", "a", "a"], ["a", "a", "a"], ["ok"] * 3, extras)
    assert result.scores == [1.0, -1.0, 1.0] and result.num_errors == 1
    assert "sample 1" in result.errors[0] and "could not send the sample" in result.errors[0]


def test_a_process_that_dies_in_the_middle_of_a_batch_fails_that_sample_only(router, batched):
    with RewardRunner(router, isolation="process", num_workers=1) as runner:
        result = score(runner, ["ok", "die", "ok", "ok"], ["a", "x", "a", "a"])
    assert result.scores == [1.0, 0.0, 1.0, 1.0] and result.num_errors == 1
    assert "sample 1" in result.errors[0] and "worker died" in result.errors[0]


class _StoppedWorker:
    is_thread = False

    def kill(self) -> None:
        self.killed = True


def test_when_a_batch_stops_a_hung_scorers_calls_count_as_failed_and_the_others_do_not(router):
    # The batch stops once it is bound to fail. Whatever a worker had started then, the hung scorer's calls
    # (running: 0; queued: 2) are its failures, and the good scorer's (running: 1; queued: 3) are only dropped,
    # so the failure count is the same however the calls were spread over the workers at that moment.
    from fleetrl.rewards.failures import check_failure_rate
    from fleetrl.rewards.runner import _Job, _Pass
    tasks = [("forever",), ("ok",), ("forever",), ("ok",)]
    st = _Pass(tasks, [2, 3], max_failure_rate=0.5, batch_size=2)
    st.hung.add("forever")
    worker = _StoppedWorker()
    st.busy = {"conn": _Job(worker, [0, 1], since=0.0)}
    runner = RewardRunner(router, isolation="process")
    runner._abandon(st)
    assert [kind for kind, _ in st.outcomes] == ["skipped", "abandoned", "skipped", "abandoned"] and worker.killed
    result = runner._collect(st.outcomes, [t[0] for t in tasks], ["f", "o", "f", "o"])
    assert result.failed_by_scorer == {"forever": 2} and result.num_skipped == 4
    with pytest.raises(ScorerFailureError, match=r"'forever' \(data_source f\) failed on 2 of 2 samples in this batch "
                                                 r"\(0 errors, 0 timeouts, 2 not run after repeated timeouts, 2 of "
                                                 r"other scorers not run, limit\)"):
        check_failure_rate(result, 0.5, "limit")


def test_a_send_to_a_frozen_idle_process_worker_fails_instead_of_blocking():
    # 16 MB is far more than the pipe buffers: the send needs the worker to read, and a stopped worker never does.
    worker = RewardWorker(multiprocessing.get_context("spawn"), io_timeout_s=0.5)
    try:
        worker.wait_ready()
        os.kill(worker._proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(OSError):
            worker.conn.send(("claims", ["x" * 16 * 2**20]))
        assert time.monotonic() - t0 < 5
    finally:
        worker.kill()  # SIGKILL ends a stopped process too


def test_a_reply_that_stops_halfway_fails_instead_of_blocking():
    ours, theirs = multiprocessing.Pipe()
    bound_pipe_io(ours, 0.3)
    os.write(theirs.fileno(), struct.pack("!i", 1000) + b"x" * 10)  # a header for 1,000 bytes, then only 10
    t0 = time.monotonic()
    with pytest.raises(BlockingIOError):
        ours.recv()
    assert time.monotonic() - t0 < 5
    ours.close()
    theirs.close()
