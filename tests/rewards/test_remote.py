"""`fleetrl serve-reward` and RemoteRewardClient: scoring, auth, limits, slow and missing servers, load sharing."""
from __future__ import annotations

import os
import queue
import re
import socket
import subprocess
import sys
import textwrap
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import requests

from fleetrl.rewards.errors import ScorerFailureError
from fleetrl.rewards.remote import RemoteRewardClient, RemoteRewardError, RewardServerLostError
from fleetrl.rewards.server import RewardServer, ServeOptions
from tests.rewards.serving import refusing_url, serving

REPO = Path(__file__).resolve().parents[2]
TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def scorers(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("scorers") / "scorers.py"
    path.write_text(textwrap.dedent("""
        import time

        def match(response, ground_truth, extra_info):
            return float(response.strip() == str(ground_truth))

        def one(response, ground_truth, extra_info):
            return 1.0

        def two(response, ground_truth, extra_info):
            return 2.0

        def broken_on_x(response, ground_truth, extra_info):
            if response == "x":
                raise RuntimeError("cannot score x")
            return 1.0

        def slow(response, ground_truth, extra_info):
            time.sleep(1.0)
            return 1.0
    """))
    return path




@contextmanager
def black_hole():
    """A TCP server that accepts every connection and never answers (a hung process, a wedged proxy)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(listener.accept()[0])
            except OSError:  # closed at the end of the test
                return

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()
        for conn in held:
            conn.close()


BATCH = dict(responses=["4", " 5 ", "x", "7"], ground_truths=["4", "5", "y", 7],
             data_sources=["gsm8k", "math", "other", "other"], extra_infos=[{}, {}, {}, None])


def test_health_and_scoring(scorers):
    with serving(fn=f"{scorers}:match", token=TOKEN) as server:
        client = RemoteRewardClient([server.url], token=TOKEN)
        client.check_health()
        # data sources named gsm8k/math still go to the served function, not the builtins.
        assert client.score(**BATCH) == [1.0, 1.0, 0.0, 1.0]
        assert client.score([], [], [], []) == []


def test_scorer_failures_are_counted_not_raised(scorers):
    with serving(fn=f"{scorers}:broken_on_x", default_score=-1.0) as a:
        result = RemoteRewardClient([a.url]).score_result(**BATCH)
    assert result.scores == [1.0, 1.0, -1.0, 1.0] and result.num_errors == 1
    assert "cannot score x" in result.errors[0]


def test_builtin_scorer_by_name():
    with serving(fn="exact_match") as server:
        assert RemoteRewardClient([server.url]).score(["a", "b"], ["a", "a"], ["d", "d"], [{}, {}]) == [1.0, 0.0]


def test_wrong_or_missing_token_is_rejected(scorers):
    with serving(fn=f"{scorers}:match", token=TOKEN) as server:
        raw = requests.post(f"{server.url}/score", json={"responses": []}, timeout=5)
        assert raw.status_code == 401 and raw.headers["WWW-Authenticate"] == "Bearer"
        assert requests.get(f"{server.url}/health", timeout=5).status_code == 401
        with pytest.raises(RemoteRewardError, match="token rejected"):
            RemoteRewardClient([server.url], token="wrong").check_health()
        start = time.monotonic()
        with pytest.raises(RemoteRewardError, match="HTTP 401 .*rewards.remote_token"):
            RemoteRewardClient([server.url], retries=3, backoff_s=5.0).score(**BATCH)
        # A 4xx is not retried: a retry would first sleep backoff_s, so anything under it means one attempt. (5 s,
        # not 1: room for one slow request to the in-process server on a loaded machine.)
        assert time.monotonic() - start < 5.0


def test_non_loopback_bind_needs_a_token(scorers):
    with pytest.raises(ValueError, match="set a token"):
        RewardServer(ServeOptions(fn=f"{scorers}:match", host="0.0.0.0", port=0))


def test_request_size_limit_and_bad_requests(scorers):
    with serving(fn=f"{scorers}:match", max_body_bytes=200) as server:
        big = {**BATCH, "responses": ["x" * 300] * 4}
        assert requests.post(f"{server.url}/score", json=big, timeout=5).status_code == 413
        with pytest.raises(RemoteRewardError, match="HTTP 413 .*--max-body-bytes"):
            RemoteRewardClient([server.url]).score(**big)
        bad = requests.post(f"{server.url}/score", data=b"{not json", timeout=5,
                            headers={"Content-Type": "application/json"})
        assert bad.status_code == 400
        uneven = requests.post(f"{server.url}/score", json={"responses": ["a"], "ground_truths": []}, timeout=5)
        assert uneven.status_code == 400
        assert "ground_truths has length 0 but responses has length 1;" in uneven.json()["error"]


def test_slow_server_times_out_retries_then_fails_clearly(scorers):
    with serving(fn=f"{scorers}:slow", num_workers=1) as server:
        client = RemoteRewardClient([server.url], timeout_s=0.3, retries=2, backoff_s=0.05)
        start = time.monotonic()
        with pytest.raises(RemoteRewardError) as err:
            client.score(["a"], ["a"], ["d"], [{}])
        elapsed = time.monotonic() - start
    message = str(err.value)
    assert "failed after 3 attempts" in message and message.count("no answer within 0.3s") == 3
    assert server.url in message and "rewards.remote_timeout_s" in message
    assert isinstance(err.value, RewardServerLostError)  # the supervisor restarts on this, like a lost worker
    assert 0.9 <= elapsed < 3.0  # three 0.3 s timeouts plus backoff, never an unbounded wait


def test_server_down_at_start_names_the_url_and_how_to_start_one(scorers):
    with refusing_url() as dead, pytest.raises(RemoteRewardError) as err:
        RemoteRewardClient([dead], timeout_s=1).check_health()
    assert f"{dead}: not reachable" in str(err.value) and "fleetrl serve-reward --fn" in str(err.value)


def test_failover_to_a_live_server(scorers):
    with serving(fn=f"{scorers}:match") as server, refusing_url() as dead:
        client = RemoteRewardClient([dead, server.url], timeout_s=2, retries=1, backoff_s=0.01)
        for _ in range(2):  # whichever server a sub-batch starts on, it ends on the live one, in order
            assert client.score(**BATCH) == [1.0, 1.0, 0.0, 1.0]
        with pytest.raises(RemoteRewardError, match="not reachable"):
            client.check_health()  # the dead one is still reported


def test_servers_share_the_load_round_robin(scorers):
    with serving(fn=f"{scorers}:one") as a, serving(fn=f"{scorers}:two") as b:
        client = RemoteRewardClient([a.url, b.url])
        assert client.score(**BATCH) == [1.0, 1.0, 2.0, 2.0]
        assert client.score(**BATCH) == [2.0, 2.0, 1.0, 1.0]  # next call starts on the next server
        assert client.score(["x"], [1], ["d"], [{}]) == [1.0]


def test_client_rejects_uneven_batches():
    with pytest.raises(ValueError, match="lengths differ"):
        RemoteRewardClient(["http://127.0.0.1:1"]).score(["a"], [], ["d"], [{}])
    with pytest.raises(ValueError, match="at least one server URL"):
        RemoteRewardClient([])


def test_serve_reward_command(scorers):
    cli = [sys.executable, "-m", "fleetrl.cli.main", "serve-reward", "--fn", f"{scorers}:match"]
    refused = subprocess.run(cli + ["--host", "0.0.0.0"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert refused.returncode == 2 and "set a token (--token-file FILE or FLEETRL_REWARD_TOKEN" in refused.stderr
    env = {**os.environ, "FLEETRL_REWARD_TOKEN": TOKEN}  # the token never appears on the command line
    # --port 0: the server binds a free port itself and names it in its start-up line. (A port found free here and
    # passed on could be taken, e.g. by a Ray starting in another pytest worker, in the seconds before the CLI,
    # importing, got to bind it.)
    proc = subprocess.Popen(cli + ["--port", "0"], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()

    def read_stderr() -> None:  # drained to the end, so the server never blocks on a full pipe
        for line in proc.stderr:
            lines.put(line)
        lines.put("")  # end of output: the process exited

    threading.Thread(target=read_stderr, daemon=True).start()
    try:
        deadline, url, seen = time.monotonic() + 30, None, []
        while url is None:
            try:
                seen.append(lines.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                pytest.fail("serve-reward did not say where it listens within 30 s: " + "".join(seen))
            assert seen[-1], "serve-reward exited: " + "".join(seen)
            found = re.search(r"serving .* at (http://127\.0\.0\.1:\d+) \(token required\)", seen[-1])
            url = found and found.group(1)
        client = RemoteRewardClient([url], token=TOKEN, timeout_s=2)
        while True:
            try:
                client.check_health()
                break
            except RemoteRewardError:
                assert time.monotonic() < deadline and proc.poll() is None, "serve-reward did not come up"
                time.sleep(0.2)
        health = requests.get(f"{url}/health", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5).json()
        assert health == {"status": "ok", "scorer": f"{scorers}:match"}
        assert client.score(**BATCH) == [1.0, 1.0, 0.0, 1.0]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_black_hole_server_fails_start_up_in_seconds_not_the_scoring_timeout():
    # Scoring timeout 120 s (the default rewards.remote_timeout_s) must not apply to the start-up check:
    # it waits remote_connect_timeout_s = 2 s per server, both servers at once.
    with black_hole() as a, black_hole() as b:
        client = RemoteRewardClient([a, b], timeout_s=120, connect_timeout_s=2)
        start = time.monotonic()
        with pytest.raises(RemoteRewardError, match=r"not reachable \(no answer within 2s; .*remote_connect_timeout_s"):
            client.check_health()
        elapsed = time.monotonic() - start
    assert elapsed < 10, f"start-up check against a black hole took {elapsed:.1f}s"


@pytest.mark.slow  # waits out a retry deadline
def test_hung_score_is_retried_within_a_bounded_time_then_recoverable():
    # 1 + 2 retries of a 1 s read timeout, backoffs 0.1 + 0.2 s: about 3.3 s, and never the 120 s default.
    # (connect_timeout_s=3: the /health probes, every 3 s, never start before the 1 s read timeout.)
    with black_hole() as hole:
        client = RemoteRewardClient([hole], timeout_s=1, retries=2, backoff_s=0.1, connect_timeout_s=3)
        start = time.monotonic()
        with pytest.raises(RewardServerLostError, match="failed after 3 attempts") as err:
            client.score(["a"], ["a"], ["d"], [{}])
        elapsed = time.monotonic() - start
    assert 3.0 <= elapsed < 6.0 and str(err.value).count("no answer within 1s") == 3


def test_remote_failure_rate_names_the_server(scorers):
    # broken_on_x fails 2 of the 3 samples it got (> 0.5 × 3): the client stops the run naming that server.
    with serving(fn=f"{scorers}:broken_on_x") as server:
        client = RemoteRewardClient([server.url], max_failure_rate=0.5)
        with pytest.raises(ScorerFailureError, match=rf"{server.url} \(.*broken_on_x\)' \(data_source d\) failed "
                                                     r"on 2 of 3 samples.*First failure: .*cannot score x"):
            client.score(["x", "x", "ok"], [1, 1, 1], ["d"] * 3, [{}] * 3)
        assert client.score(["x", "ok", "ok"], [1, 1, 1], ["d"] * 3, [{}] * 3) == [0.0, 1.0, 1.0]


def test_frozen_server_is_given_up_on_by_health_probes_not_the_scoring_timeout():
    # /score timeout 120 s, but the black hole also misses /health: probes every 0.3 s (each waiting up to 0.3 s),
    # 2 misses in a row end the attempt after about 2 × (0.3 + 0.3) = 1.2 s. No retries: one attempt.
    with black_hole() as hole:
        client = RemoteRewardClient([hole], timeout_s=120, retries=0, connect_timeout_s=0.3)
        start = time.monotonic()
        with pytest.raises(RewardServerLostError, match=r"stopped answering /health while scoring \(2 checks"):
            client.score(["a"], ["a"], ["d"], [{}])
        assert time.monotonic() - start < 5.0


@contextmanager
def trickling_server():
    """Answers /health at once, and /score with a 1,000-byte body sent one byte per 0.1 s: each read returns well
    inside any read timeout, so only a deadline on the whole answer ends the call."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            try:
                for _ in range(1000):
                    self.wfile.write(b" ")
                    self.wfile.flush()
                    time.sleep(0.1)
            except OSError:  # the client gave up
                pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_an_answer_that_never_completes_ends_at_the_scoring_deadline():
    # 2 x (timeout 1 s + 0.2 s to connect): the trickle (100 s) is cut at ~2.4-2.6 s although /health answers.
    with trickling_server() as url:
        client = RemoteRewardClient([url], timeout_s=1, retries=0, connect_timeout_s=0.2)
        start = time.monotonic()
        with pytest.raises(RewardServerLostError, match=r"no complete answer to /score within 2 x "
                                                        r"\(rewards.remote_timeout_s=1s"):
            client.score(["a"], ["a"], ["d"], [{}])
        assert time.monotonic() - start < 5.0


def test_slow_scorer_on_a_live_server_keeps_its_full_timeout(scorers):
    # "slow" takes 1 s per sample; probes every 0.2 s get answers (the server is alive), so the attempt is not cut.
    with serving(fn=f"{scorers}:slow") as server:
        client = RemoteRewardClient([server.url], timeout_s=5, retries=0, connect_timeout_s=0.2)
        assert client.score(["a"], ["a"], ["d"], [{}]) == [1.0]
