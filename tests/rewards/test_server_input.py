"""`fleetrl serve-reward` against bad bodies and busy slots: wrongly typed fields and JSON nested absurdly deep get a
400 naming the field and the fix (never a 500 or a dropped connection); /health answers while every handler slot
is held."""
from __future__ import annotations

import json
import socket
import time
from contextlib import ExitStack
from typing import Any

import pytest
import requests

from fleetrl.rewards.server import validate_batch
from tests.rewards.serving import serving

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
DS_FIX = 'send one name per response, e.g. "data_sources": ["math", ...], or leave the field out'


def _post(url: str, body: Any) -> requests.Response:
    try:
        return requests.post(f"{url}/score", data=body if isinstance(body, (str, bytes)) else json.dumps(body),
                             headers={"Content-Type": "application/json"}, timeout=10)
    except requests.ConnectionError as e:  # a dropped connection is the bug, not an error of the test
        pytest.fail(f"the server dropped the connection without an answer: {e}")


def test_list_in_data_sources_is_a_400_naming_the_field():
    with serving(fn="exact_match") as server:
        reply = _post(server.url, {"responses": ["a"], "ground_truths": ["a"], "data_sources": [["x"]]})
    assert reply.status_code == 400
    assert reply.json() == {"error": "bad request: data_sources[0] must be a string (the data source name), got an "
                                     f'array ["x"]; {DS_FIX}'}


@pytest.mark.parametrize("body, expected", [
    ({"responses": ["a", "b"], "data_sources": ["d", 7]},
     f"data_sources[1] must be a string (the data source name), got a number 7; {DS_FIX}"),
    ({"responses": ["a"], "data_sources": [None]},
     f"data_sources[0] must be a string (the data source name), got null; {DS_FIX}"),
    ({"responses": ["a"], "data_sources": "math"},
     f'data_sources must be an array with one entry per response, got a string "math"; {DS_FIX}'),
    ({"responses": ["a", "b"], "data_sources": ["d"]},
     f"data_sources has length 1 but responses has length 2; {DS_FIX}"),
    ({"responses": [["a"]]},
     'responses[0] must be a string (the response text), got an array ["a"]; send the texts to score, e.g. '
     '"responses": ["The answer is 4.", ...]'),
    ({"responses": "a"},
     'responses must be an array with one entry per response, got a string "a"; send the texts to score, e.g. '
     '"responses": ["The answer is 4.", ...]'),
    ({"ground_truths": ["a"]},
     'the body has no "responses"; send the texts to score, e.g. "responses": ["The answer is 4.", ...]'),
    ([1, 2],
     'the body must be a JSON object, got an array [1, 2]; send e.g. {"responses": ["The answer is 4."], '
     '"ground_truths": ["4"]}'),
    ({"responses": ["a"], "ground_truths": {"0": "a"}},
     'ground_truths must be an array with one entry per response, got an object {"0": "a"}; send one per '
     'response, e.g. "ground_truths": ["4", ...], or leave the field out'),
    ({"responses": ["a"], "extra_infos": ["x"]},
     'extra_infos[0] must be a JSON object or null, got a string "x"; send one object per response, e.g. '
     '"extra_infos": [{"split": "train"}, ...], or leave the field out'),
    ({"responses": ["a"], "extra_infos": [[1]]},
     'extra_infos[0] must be a JSON object or null, got an array [1]; send one object per response, e.g. '
     '"extra_infos": [{"split": "train"}, ...], or leave the field out'),
    ({"responses": ["a"], "prompts": [1]},
     'prompts[0] must be a string or a list of chat messages (JSON objects), got a number 1; send one per '
     'response, e.g. "prompts": ["What is 2+2?", ...] or [[{"role": "user", "content": "What is 2+2?"}], ...]'),
    ({"responses": ["a"], "prompts": [["hi"]]},
     'prompts[0] must be a string or a list of chat messages (JSON objects), got an array ["hi"]; send one per '
     'response, e.g. "prompts": ["What is 2+2?", ...] or [[{"role": "user", "content": "What is 2+2?"}], ...]'),
])
def test_wrongly_typed_fields_name_the_field_what_was_expected_and_the_fix(body: Any, expected: str):
    with pytest.raises(ValueError) as err:
        validate_batch(body)
    assert str(err.value) == expected


def test_wrongly_typed_fields_are_400_over_http():
    # The runner would have met these as a 500 (unhashable list, int.startswith) or silently scored them.
    bodies = [{"responses": ["a"], "data_sources": [{}]}, {"responses": ["a"], "extra_infos": [5]},
              {"responses": [None]}, {"responses": ["a"], "prompts": "a"}]
    with serving(fn="exact_match") as server:
        replies = [_post(server.url, body) for body in bodies]
    assert [r.status_code for r in replies] == [400, 400, 400, 400]
    assert [r.json()["error"].split(" must be ")[0] for r in replies] == [
        "bad request: data_sources[0]", "bad request: extra_infos[0]", "bad request: responses[0]",
        "bad request: prompts"]


def test_valid_bodies_still_score():
    # exact_match: "a" == "a" -> 1.0, "b" != "a" -> 0.0. Omitted or null optional fields take their defaults; a null
    # extra_info is {}; chat-message prompts are accepted (and unused) by a --fn server.
    prompts = [[{"role": "user", "content": "say a"}], "say a"]
    with serving(fn="exact_match") as server:
        full = _post(server.url, {"responses": ["a", "b"], "ground_truths": ["a", "a"], "data_sources": ["d", "e"],
                                  "extra_infos": [None, {"k": [1, {"j": 2}]}], "prompts": prompts})
        bare = _post(server.url, {"responses": ["a", "b"], "ground_truths": ["a", "a"], "data_sources": None})
    assert full.status_code == 200 and full.json()["scores"] == [1.0, 0.0]
    assert bare.status_code == 200 and bare.json()["scores"] == [1.0, 0.0]


def _nested(levels: int) -> Any:
    value: Any = []
    for _ in range(levels - 1):
        value = [value]
    return value


def test_json_nested_100000_deep_gets_a_400_not_a_dropped_connection():
    with serving(fn="exact_match") as server:
        reply = _post(server.url, "[" * 100_000 + "]" * 100_000)
        assert reply.status_code == 400
        assert reply.json()["error"].startswith("bad request: JSON nested deeper than 100 levels;")
        # Depth counts containers: the body object 1, extra_infos 2, its entry 3, then `k` lists -> 3 + k.
        at_limit = {"responses": ["a"], "ground_truths": ["a"], "extra_infos": [{"k": _nested(97)}]}
        over = {"responses": ["a"], "ground_truths": ["a"], "extra_infos": [{"k": _nested(98)}]}
        assert _post(server.url, at_limit).json()["scores"] == [1.0]
        too_deep = _post(server.url, over)
        assert too_deep.status_code == 400 and "nested deeper than 100 levels" in too_deep.json()["error"]
        # The server is still whole afterwards.
        assert _post(server.url, {"responses": ["b"], "ground_truths": ["a"]}).json()["scores"] == [0.0]


def test_health_answers_at_once_while_every_handler_slot_is_held():
    # 32 (the default max_connections) authenticated requests whose bodies never come hold every handler slot for
    # read_timeout_s = 30 s. /health must still answer 200 at once; scoring is what is busy (503).
    stalled = (b"POST /score HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode() +
               b"\r\nContent-Length: 100\r\n\r\n{")
    with serving(fn="exact_match", token=TOKEN, read_timeout_s=30) as server, ExitStack() as stack:
        host, port = server.url.removeprefix("http://").split(":")
        for _ in range(32):
            stack.enter_context(socket.create_connection((host, int(port)), timeout=5)).sendall(stalled)
        deadline = time.monotonic() + 15
        while server._slots._value > 0:  # the selector thread reads the 32 heads and hands each a slot
            assert time.monotonic() < deadline, "the 32 stalled requests never held all 32 handler slots"
            time.sleep(0.05)
        start = time.monotonic()
        health = requests.get(f"{server.url}/health", headers=AUTH, timeout=5)
        took = time.monotonic() - start
        assert health.status_code == 200 and health.json() == {"status": "ok", "scorer": "exact_match"}
        assert took < 0.5
        assert requests.get(f"{server.url}/health", timeout=5).status_code == 401  # the token still applies
        busy = requests.post(f"{server.url}/score", json={"responses": ["a"]}, headers=AUTH, timeout=5)
        assert busy.status_code == 503
