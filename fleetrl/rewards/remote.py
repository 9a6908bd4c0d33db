"""RemoteRewardClient: scores batches on one or more `fleetrl serve-reward` servers.

A batch is cut into one contiguous sub-batch per server and sent in parallel; which server gets which
sub-batch rotates from call to call (round-robin). A sub-batch whose server times out, refuses the
connection or answers 5xx is retried on the next server after a backoff (failover), up to `retries` times;
then the call raises RemoteRewardError naming every server and what it answered. A 4xx answer is a
request or configuration problem (wrong token, batch too large) and is raised at once.
"""
from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import requests

from fleetrl.rewards.runner import RewardResult

START_HINT = ("start one with `fleetrl serve-reward --fn path/to/file.py:fn --host 0.0.0.0 --port 8000 --token "
              "SECRET` and list it in rewards.remote_urls (with rewards.remote_token = SECRET)")


class RemoteRewardError(RuntimeError):
    """The reward servers could not score a batch, or are not reachable; the message says which and why."""


class _Refused(Exception):
    """A 4xx answer: retrying elsewhere would not help."""


class RemoteRewardClient:
    def __init__(self, urls: Sequence[str], *, token: str | None = None, timeout_s: float = 10.0,
                 retries: int = 3, backoff_s: float = 0.5) -> None:
        if not urls:
            raise ValueError(f"RemoteRewardClient needs at least one server URL; {START_HINT}")
        self.urls = [_normalize(u) for u in urls]
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._turn = itertools.count()
        self._turn_lock = threading.Lock()

    def check_health(self) -> None:
        """Raises RemoteRewardError unless every server answers GET /health (training refuses to start)."""
        problems = []
        for url in self.urls:
            try:
                r = requests.get(f"{url}/health", headers=self._headers, timeout=self.timeout_s)
            except requests.RequestException as e:
                problems.append(f"{url}: not reachable ({_reason(e, self.timeout_s)})")
                continue
            if r.status_code == 401:
                problems.append(f"{url}: token rejected (set rewards.remote_token to the server's --token)")
            elif r.status_code != 200:
                problems.append(f"{url}: /health answered HTTP {r.status_code}")
        if problems:
            raise RemoteRewardError("reward server check failed: " + "; ".join(problems) + f". {START_HINT}")

    def score(self, responses: list[str], ground_truths: list, data_sources: list[str],
              extra_infos: list[dict]) -> list[float]:
        """One score per response, in order (a sample the server's scorer failed on gets its default score)."""
        return self.score_result(responses, ground_truths, data_sources, extra_infos).scores

    def score_result(self, responses: list[str], ground_truths: list, data_sources: list[str],
                     extra_infos: list[dict]) -> RewardResult:
        """Like score, with the servers' error and timeout counts: the same result as RewardRunner.score."""
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
                     "data_sources": data_sources[a:b], "extra_infos": extra_infos[a:b]} for a, b in bounds]
        with ThreadPoolExecutor(max_workers=parts) as pool:
            replies = list(pool.map(self._send, payloads, [(first + i) % len(self.urls) for i in range(parts)]))
        return _merge(replies)

    def _send(self, payload: dict, start: int) -> dict:
        """POSTs one sub-batch, moving to the next server after each failure, with exponential backoff."""
        failures: list[str] = []
        for attempt in range(self.retries + 1):
            url = self.urls[(start + attempt) % len(self.urls)]
            try:
                return self._post(url, payload)
            except _Refused as e:
                raise RemoteRewardError(str(e)) from None
            except (requests.RequestException, ValueError) as e:
                failures.append(f"{url}: {_reason(e, self.timeout_s)}")
            if attempt < self.retries:
                time.sleep(self.backoff_s * 2**attempt)
        raise RemoteRewardError(f"scoring {len(payload['responses'])} samples failed after {self.retries + 1} "
                                f"attempts: " + "; ".join(failures) + ". Check the servers' logs, raise "
                                f"rewards.timeout_s if scoring is slow, or {START_HINT}")

    def _post(self, url: str, payload: dict) -> dict:
        r = requests.post(f"{url}/score", json=payload, headers=self._headers, timeout=self.timeout_s)
        if 400 <= r.status_code < 500 and r.status_code not in (408, 429):
            hint = {401: " (set rewards.remote_token to the server's --token)",
                    413: " (send smaller batches or start the server with a larger --max-body-bytes)"}
            raise _Refused(f"{url} refused the batch: HTTP {r.status_code} {_error_text(r)}"
                           f"{hint.get(r.status_code, '')}")
        if r.status_code != 200:
            raise ValueError(f"HTTP {r.status_code} {_error_text(r)}")
        body = r.json()
        if len(body.get("scores", [])) != len(payload["responses"]):
            raise ValueError(f"answered {len(body.get('scores', []))} scores for {len(payload['responses'])} samples")
        return body


def _merge(replies: list[dict]) -> RewardResult:
    result = RewardResult(scores=[])
    for body in replies:
        result.scores.extend(float(s) for s in body["scores"])
        result.num_errors += int(body.get("num_errors", 0))
        result.num_timeouts += int(body.get("num_timeouts", 0))
        result.errors.extend(body.get("errors", []))
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
