"""RemoteRewardClient: scores batches on one or more `fleetrl serve-reward` servers.

A batch is cut into one contiguous sub-batch per server and sent in parallel; which server gets which
sub-batch rotates from call to call (round-robin). A sub-batch whose server times out, refuses the
connection or answers 5xx is retried on the next server after a backoff (failover), up to `retries` times;
then the call raises RewardServerLostError naming every server and what it answered: the supervisor treats it
like a lost worker (restart from the last checkpoint, whose start-up health check then says whether the servers
are back). A 4xx answer is a request or configuration problem (wrong token, batch too large) and raises
RemoteRewardError at once. Every wait is bounded: connecting by `connect_timeout_s`, the start-up /health check
by `connect_timeout_s` (a server that accepts and never answers fails start-up in seconds, not after the
scoring timeout), one /score by `timeout_s`, so one sub-batch by (retries + 1) × timeout_s + the backoffs.
While a /score is pending the client probes /health every `connect_timeout_s`; a server that misses
HEALTH_MISSES probes in a row is frozen, and the attempt ends then rather than after `timeout_s`.
"""
from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import requests

from fleetrl.errors import UserError
from fleetrl.rewards.failures import RewardResult, check_failure_rate

HEALTH_MISSES = 2  # /health probes in a row without an answer that end a /score attempt early
START_HINT = ("start one with `FLEETRL_REWARD_TOKEN=SECRET fleetrl serve-reward --fn path/to/file.py:fn --host 0.0.0.0 "
              "--port 8000` and list it in rewards.remote_urls (with rewards.remote_token = SECRET)")


class RemoteRewardError(UserError, RuntimeError):
    """The reward servers could not score a batch, or are not reachable; the message says which and why."""


class RewardServerLostError(RemoteRewardError):
    """Every attempt at a sub-batch failed (timeout, refused connection, 5xx): recoverable like a lost worker."""


class _Frozen(Exception):
    """During a /score the server stopped answering /health, or it gave no complete answer in time: retrying
    elsewhere may help."""


class _Refused(Exception):
    """A 4xx answer: retrying elsewhere would not help."""


class RemoteRewardClient:
    def __init__(self, urls: Sequence[str], *, token: str | None = None, timeout_s: float = 10.0,
                 retries: int = 2, backoff_s: float = 1.0, connect_timeout_s: float = 5.0,
                 max_failure_rate: float = 1.0) -> None:
        if not urls:
            raise ValueError(f"RemoteRewardClient needs at least one server URL; {START_HINT}")
        self.urls = [_normalize(u) for u in urls]
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.connect_timeout_s = connect_timeout_s
        self.max_failure_rate = max_failure_rate
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._turn = itertools.count()
        self._turn_lock = threading.Lock()

    def check_health(self) -> None:
        """Raises RemoteRewardError unless every server answers GET /health (training refuses to start)."""
        with ThreadPoolExecutor(max_workers=len(self.urls)) as pool:  # N servers cost one timeout, not N
            problems = [p for p in pool.map(self._health_problem, self.urls) if p]
        if problems:
            raise RemoteRewardError("reward server check failed: " + "; ".join(problems) + f". {START_HINT}")

    def _health_problem(self, url: str) -> str | None:
        wait = self.connect_timeout_s
        try:
            r = requests.get(f"{url}/health", headers=self._headers, timeout=(wait, wait))
        except requests.RequestException as e:
            return (f"{url}: not reachable ({_reason(e, wait)}; the start-up check allows "
                    f"rewards.remote_connect_timeout_s={wait:g}s)")
        if r.status_code == 401:
            return f"{url}: token rejected (set rewards.remote_token to the server's token)"
        if r.status_code != 200:
            return f"{url}: /health answered HTTP {r.status_code}"
        return None

    def score(self, responses: list[str], ground_truths: list, data_sources: list[str],
              extra_infos: list[dict]) -> list[float]:
        """One score per response, in order (a sample the server's scorer failed on gets its default score)."""
        return self.score_result(responses, ground_truths, data_sources, extra_infos).scores

    def score_result(self, responses: list[str], ground_truths: list, data_sources: list[str],
                     extra_infos: list[dict], prompts: list | None = None) -> RewardResult:
        """Like score, with the servers' error and timeout counts: the same result as RewardRunner.score.
        `prompts` (text or chat messages) go along for servers that host a reward model."""
        n = len(responses)
        if not (len(ground_truths) == len(data_sources) == len(extra_infos) == n):
            raise ValueError(f"RemoteRewardClient.score: lengths differ (responses {n}, ground_truths "
                             f"{len(ground_truths)}, data_sources {len(data_sources)}, extra_infos {len(extra_infos)})")
        if n == 0:
            return RewardResult(scores=[])
        parts = min(len(self.urls), n)
        with self._turn_lock:
            first = next(self._turn) % len(self.urls)
        bounds = [(i * n // parts, (i + 1) * n // parts) for i in range(parts)]
        payloads = [{"responses": responses[a:b], "ground_truths": ground_truths[a:b],
                     "data_sources": data_sources[a:b], "extra_infos": extra_infos[a:b],
                     **({"prompts": prompts[a:b]} if prompts is not None else {})} for a, b in bounds]
        with ThreadPoolExecutor(max_workers=parts) as pool:
            replies = list(pool.map(self._send, payloads, [(first + i) % len(self.urls) for i in range(parts)]))
        result = _merge(replies, [p["data_sources"] for p in payloads])
        check_failure_rate(result, self.max_failure_rate, "counted by the reward servers")
        return result

    def _send(self, payload: dict, start: int) -> tuple[str, dict]:
        """POSTs one sub-batch, moving to the next server after each failure, with exponential backoff."""
        failures: list[str] = []
        for attempt in range(self.retries + 1):
            url = self.urls[(start + attempt) % len(self.urls)]
            try:
                return url, self._post_watched(url, payload)
            except _Refused as e:
                raise RemoteRewardError(str(e)) from None
            except _Frozen as e:
                failures.append(f"{url}: {e}")
            except (requests.RequestException, ValueError) as e:
                failures.append(f"{url}: {_reason(e, self.timeout_s)}")
            if attempt < self.retries:
                time.sleep(self.backoff_s * 2**attempt)
        raise RewardServerLostError(
            f"scoring {len(payload['responses'])} samples failed after {self.retries + 1} attempts "
            f"(rewards.remote_retries={self.retries}): " + "; ".join(failures) + ". Check the servers' logs, raise "
            f"rewards.remote_timeout_s if scoring is only slow, or {START_HINT}")

    def _post_watched(self, url: str, payload: dict) -> dict:
        """_post, given up early when the server stops answering /health while it scores (a frozen process or
        host), instead of after the full timeout_s. A slow scorer on a live server still gets all of timeout_s.
        The abandoned request's thread ends at its own timeout."""
        done, box = threading.Event(), {}

        def post() -> None:
            try:
                box["body"] = self._post(url, payload)
            except BaseException as e:  # noqa: BLE001 — handed to the caller's thread as is
                box["error"] = e
            finally:
                done.set()

        threading.Thread(target=post, daemon=True, name="fleetrl-reward-post").start()
        # requests' read timeout bounds each socket read, not the answer: a peer (a proxy, a third-party server)
        # that trickles its body, or answers /health while /score never completes, would hold the call forever.
        # Twice timeout_s: this clock also runs while a large batch uploads, which the read timeout does not count.
        deadline = time.monotonic() + 2 * (self.timeout_s + self.connect_timeout_s)
        misses = 0
        while not done.wait(self.connect_timeout_s):
            misses = 0 if self._answers(url) else misses + 1
            if misses == HEALTH_MISSES:
                raise _Frozen(f"stopped answering /health while scoring ({HEALTH_MISSES} checks of "
                              f"{self.connect_timeout_s:g}s, rewards.remote_connect_timeout_s)")
            if time.monotonic() > deadline:
                raise _Frozen(f"gave no complete answer to /score within 2 x (rewards.remote_timeout_s={self.timeout_s:g}s"
                              f" + {self.connect_timeout_s:g}s to connect), though it answers /health")
        if "error" in box:
            raise box["error"]
        return box["body"]

    def _answers(self, url: str) -> bool:
        """Any HTTP answer (even 503: all handler slots busy) means the server process is alive."""
        try:
            requests.get(f"{url}/health", headers=self._headers, timeout=(self.connect_timeout_s,) * 2)
            return True
        except requests.RequestException:
            return False

    def _post(self, url: str, payload: dict) -> dict:
        r = requests.post(f"{url}/score", json=payload, headers=self._headers,
                          timeout=(self.connect_timeout_s, self.timeout_s))
        if 400 <= r.status_code < 500 and r.status_code not in (408, 429):
            hint = {401: " (set rewards.remote_token to the server's token: its --token-file or FLEETRL_REWARD_TOKEN)",
                    413: " (send smaller batches or start the server with a larger --max-body-bytes)"}
            raise _Refused(f"{url} refused the batch: HTTP {r.status_code} {_error_text(r)}"
                           f"{hint.get(r.status_code, '')}")
        if r.status_code != 200:
            raise ValueError(f"HTTP {r.status_code} {_error_text(r)}")
        body = r.json()
        if len(body.get("scores", [])) != len(payload["responses"]):
            raise ValueError(f"answered {len(body.get('scores', []))} scores for {len(payload['responses'])} samples")
        return body


def _merge(replies: list[tuple[str, dict]], sources: list[list[str]]) -> RewardResult:
    """Sub-batch answers -> one result; failures are counted per server (each serves one scorer)."""
    result = RewardResult(scores=[])
    for (url, body), part_sources in zip(replies, sources, strict=True):
        failed = sum(int(body.get(k, 0)) for k in ("num_errors", "num_timeouts", "num_skipped"))
        result.scores.extend(float(s) for s in body["scores"])
        result.num_errors += int(body.get("num_errors", 0))
        result.num_timeouts += int(body.get("num_timeouts", 0))
        result.num_skipped += int(body.get("num_skipped", 0))
        result.errors.extend(body.get("errors", []))
        scorer = f"{url} ({body.get('scorer', 'remote')})"
        result.samples_by_scorer[scorer] = result.samples_by_scorer.get(scorer, 0) + len(body["scores"])
        result.failed_by_scorer[scorer] = result.failed_by_scorer.get(scorer, 0) + failed
        result.sources_by_scorer.setdefault(scorer, set()).update(part_sources)
    return result


def _normalize(url: str) -> str:
    url = url.strip().rstrip("/")
    return url if "://" in url else f"http://{url}"


def _reason(e: Exception, timeout_s: float | None = None) -> str:
    if isinstance(e, requests.Timeout):
        return f"no answer within {timeout_s:g}s" if timeout_s else "timed out"
    if isinstance(e, requests.ConnectionError):
        return "connection refused or host unreachable"
    return str(e)


def _error_text(r: Any) -> str:
    try:
        return str(r.json().get("error", ""))[:300]
    except ValueError:
        return r.text[:300]
