"""`fleetrl serve-reward`: a scorer behind HTTP, for rewards that need their own machine or environment.

    GET  /health -> {"status": "ok", "scorer": SPEC}
    POST /score  {"responses": [...], "ground_truths": [...], "data_sources": [...], "extra_infos": [...]}
              -> {"scores": [...], "num_errors": N, "num_timeouts": N, "num_skipped": N, "errors": [...],
                  "scorer": SPEC}

With `--model` the server hosts a reward model instead (config/reward_model.py; scalar head or judge) and
scores (prompt, response): the body then needs `prompts` too (text or chat messages, one per response), which
the trainer's client sends. Otherwise scoring goes through the same RewardRunner as local rewards, so a stuck or crashing scorer costs one
sample's default score, never a hung request. Every route needs `Authorization: Bearer TOKEN` when a token
is set (from `--token-file` or FLEETRL_REWARD_TOKEN, never the command line), and a token is mandatory whenever
the server listens beyond loopback. Bodies above `max_body_bytes` are refused with 413 before they are read; a
body with a wrongly typed field, or JSON nested deeper than MAX_JSON_DEPTH levels, gets a 400 naming the fix.

A server meant to face a network must not let idle or half-sent connections use it up (slowloris). One
selector thread accepts connections and reads each request's head without blocking; a connection gets a
handler thread only once its head is complete, and at most `max_connections` handler threads exist (beyond
that: 503 at once). A head not complete within `read_timeout_s`, or a body read that stalls for as long, closes
the connection; at most `max_pending` connections may be waiting for their head (beyond that: closed at
accept). Every answer closes its connection, so an idle keep-alive never holds a thread. GET /health is answered
by the selector thread itself, without a handler slot: clients holding every slot cannot make a live server look
dead to health checks.
"""
from __future__ import annotations

import hmac
import io
import ipaddress
import json
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any, Callable

from fleetrl.config.reward_model import RewardModelConfig
from fleetrl.rewards.errors import RewardError
from fleetrl.rewards.registry import RewardRouter
from fleetrl.rewards.runner import RewardRunner

log = logging.getLogger("fleetrl.rewards.server")
FIELDS = ("responses", "ground_truths", "data_sources", "extra_infos")
MAX_HEAD_BYTES = 64 * 2**10
TOKEN_ENV = "FLEETRL_REWARD_TOKEN"
MAX_JSON_DEPTH = 100
"""Containers nested in a request body (the body object counts 1). Real batches need a handful; json's C parser
recurses once per level and raises RecursionError near 1000, which must be a 400, not a dropped connection."""
_UNAUTHORIZED = {"error": "missing or wrong bearer token; clients pass the server's token (rewards.remote_token)"}
_BUSY = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


@dataclass(frozen=True, kw_only=True, slots=True)
class ServeOptions:
    fn: str = ""
    """Scorer spec: `path/to/file.py:fn` or a builtin name; it scores every data source."""
    model: RewardModelConfig | None = None
    """Serve this reward model instead of `fn`."""
    host: str = "127.0.0.1"
    port: int = 8000
    token: str | None = None
    max_body_bytes: int = 64 * 2**20
    timeout_s: float = 30.0
    """Per-sample limit inside the server; a sample over it gets default_score."""
    default_score: float = 0.0
    num_workers: int = 8
    max_connections: int = 32
    """Requests handled at once (one thread each); more get 503 at once, never a queued thread."""
    read_timeout_s: float = 10.0
    """A request's head must arrive within this; a body read may stall at most this long."""
    max_pending: int = 512
    """Connections that may wait for their request head at once (file descriptors only, no threads)."""


def resolve_token(token_file: Path | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The server's token from --token-file, else FLEETRL_REWARD_TOKEN, else none. Never from argv: every user of
    the machine reads a command line in `ps` (the CLI refuses --token)."""
    if token_file is not None:
        try:
            text = Path(token_file).read_text().strip()
        except OSError as e:
            raise ValueError(f"--token-file {token_file}: cannot read it ({e.strerror}); write the token there "
                             f"(e.g. `openssl rand -hex 32 > {token_file}; chmod 600 {token_file}`)") from None
        if not text:
            raise ValueError(f"--token-file {token_file} is empty; write the token there")
        return text
    return environ.get(TOKEN_ENV) or None


class RewardServer:
    """Serves one scorer; `serve_forever()` blocks (the accept/head-reading loop), `close()` stops it."""

    def __init__(self, opts: ServeOptions) -> None:
        if not opts.token and not _is_loopback(opts.host):
            raise ValueError(f"--host {opts.host} exposes the reward server beyond this machine; set a token "
                             f"(--token-file FILE or {TOKEN_ENV}; clients send it as a Bearer token) or bind "
                             f"--host 127.0.0.1")
        if opts.max_connections < 1 or opts.max_pending < 1 or not opts.read_timeout_s > 0:
            raise ValueError(f"max_connections and max_pending must be >= 1 and read_timeout_s > 0; got "
                             f"{opts.max_connections}, {opts.max_pending}, {opts.read_timeout_s}")
        if (opts.model is None) == (not opts.fn):
            raise ValueError("give exactly one of --fn (a reward function) and --model (a reward model)")
        self.rm, self.runner = None, None
        if opts.model is not None:
            from fleetrl.rewards.model import build_scorer, pick_device

            self.rm = build_scorer(opts.model, pick_device())
        else:  # "*" routes every data source to this scorer (family defaults like "math" never apply).
            self.runner = RewardRunner(_router(opts.fn), timeout_s=opts.timeout_s,
                                       default_score=opts.default_score, num_workers=opts.num_workers)
        self.opts = opts
        self.spec = opts.fn or f"model:{opts.model.path}"
        self._lock = threading.Lock()  # one batch at a time through the runner; a batch runs in parallel
        self._slots = threading.BoundedSemaphore(opts.max_connections)
        self._handler = _handler_for(self)
        self._listener = socket.create_server((opts.host, opts.port), backlog=128)
        self._listener.setblocking(False)
        host, port = self._listener.getsockname()[:2]
        self._url = f"http://{host}:{port}"
        self._wake_r, self._wake_w = socket.socketpair()
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self._stopped.set()  # until serve_forever runs

    @property
    def url(self) -> str:
        return self._url

    def serve_forever(self) -> None:
        self._stopped.clear()
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        pending: dict[socket.socket, tuple[bytearray, float, Any]] = {}  # conn -> (head so far, deadline, addr)
        try:
            while not self._stopping.is_set():
                for key, _ in sel.select(timeout=0.5):
                    if key.fileobj is self._listener:
                        self._accept(sel, pending)
                    elif key.fileobj is not self._wake_r:
                        self._read_head(sel, pending, key.fileobj)  # type: ignore[arg-type]
                now = time.monotonic()
                for conn in [c for c, (_, deadline, _) in pending.items() if deadline < now]:
                    _drop(sel, pending, conn)  # head not complete within read_timeout_s
        finally:
            for conn in list(pending):
                _drop(sel, pending, conn)
            sel.close()
            self._stopped.set()

    def close(self) -> None:
        self._stopping.set()
        self._wake_w.send(b"x")
        self._stopped.wait(timeout=10)
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()
        if self.runner is not None:
            self.runner.close()

    def score(self, batch: dict[str, Any]) -> dict[str, Any]:
        if self.rm is not None:
            return self._score_model(batch)
        with self._lock:
            result = self.runner.score(*(batch[k] for k in FIELDS))
        return {"scores": result.scores, "num_errors": result.num_errors, "num_timeouts": result.num_timeouts,
                "num_skipped": result.num_skipped, "errors": result.errors, "scorer": self.spec}

    def _score_model(self, batch: dict[str, Any]) -> dict[str, Any]:
        with self._lock:  # one forward at a time: the model is not re-entrant on one device
            out = self.rm.score(batch["prompts"], [str(r) for r in batch["responses"]])
        return {"scores": out.scores_B.tolist(), "num_errors": 0, "num_timeouts": 0, "num_skipped": 0, "errors": [],
                "num_unparsed": int(out.unparsed_B.sum()), "scorer": self.spec}

    # ------------------------------------------------------------------------------------- connections
    def _accept(self, sel: selectors.BaseSelector, pending: dict) -> None:
        while True:
            try:
                conn, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # e.g. out of file descriptors: shed this connection, keep serving
                log.warning("accept failed: %s", e)
                return
            if len(pending) >= self.opts.max_pending:
                conn.close()
                continue
            conn.setblocking(False)
            sel.register(conn, selectors.EVENT_READ)
            pending[conn] = (bytearray(), time.monotonic() + self.opts.read_timeout_s, addr)

    def _read_head(self, sel: selectors.BaseSelector, pending: dict, conn: socket.socket) -> None:
        head, _, addr = pending[conn]
        try:
            data = conn.recv(MAX_HEAD_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        head += data
        if not data or (b"\r\n\r\n" not in head and len(head) >= MAX_HEAD_BYTES):
            _drop(sel, pending, conn)  # closed by the client, or a head no real client sends
        elif b"\r\n\r\n" in head:
            sel.unregister(conn)
            del pending[conn]
            if not self._answer_health(conn, bytes(head)):
                self._dispatch(conn, bytes(head), addr)

    def _answer_health(self, conn: socket.socket, head: bytes) -> bool:
        """Answers GET /health here, on the selector thread, without a handler slot: clients holding every slot
        (stalled bodies, slow scoring) must not make a live server look dead. The reply is a few hundred bytes, so
        one send into a fresh socket's empty buffer never blocks. False: not a health check."""
        request_line, *header_lines = head.split(b"\r\n\r\n", 1)[0].split(b"\r\n")
        parts = request_line.split()
        if len(parts) != 3 or parts[0] != b"GET" or parts[1].rstrip(b"/") != b"/health":
            return False
        given = b""
        for line in header_lines:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"authorization":
                given = value.strip()
        if self._token_ok(given):
            reply = _response(200, {"status": "ok", "scorer": self.spec})
        else:
            reply = _response(401, _UNAUTHORIZED, {"WWW-Authenticate": "Bearer"})
        try:
            conn.send(reply)
        except OSError:  # the client already left
            pass
        conn.close()
        return True

    def _token_ok(self, authorization: bytes) -> bool:
        """Whether an Authorization header value (raw bytes) carries this server's token (any, when none is set)."""
        token = self.opts.token
        return not token or hmac.compare_digest(authorization, f"Bearer {token}".encode())

    def _dispatch(self, conn: socket.socket, head: bytes, addr: Any) -> None:
        if not self._slots.acquire(blocking=False):
            try:
                conn.send(_BUSY)
            except OSError:
                pass
            conn.close()
            return
        conn.setblocking(True)
        conn.settimeout(self.opts.read_timeout_s)
        threading.Thread(target=self._handle, args=(conn, head, addr), daemon=True, name="fleetrl-reward-http").start()

    def _handle(self, conn: socket.socket, head: bytes, addr: Any) -> None:
        try:
            self._handler((conn, head), addr, self)
        except OSError:  # the client left or stalled mid-request; nothing to answer
            pass
        finally:
            conn.close()
            self._slots.release()


def _drop(sel: selectors.BaseSelector, pending: dict, conn: socket.socket) -> None:
    sel.unregister(conn)
    del pending[conn]
    conn.close()


def _response(status: int, body: dict, headers: Mapping[str, str] | None = None) -> bytes:
    """A whole HTTP/1.1 answer with a JSON body that closes its connection (the selector thread sends it raw)."""
    data = json.dumps(body).encode()
    lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", "Content-Type: application/json",
             f"Content-Length: {len(data)}", "Connection: close", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + data


class _Prefixed(io.RawIOBase):
    """A socket's byte stream with the already-read request head put back in front."""

    def __init__(self, head: bytes, conn: socket.socket) -> None:
        self._head, self._conn = memoryview(head), conn

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        if self._head:
            n = min(len(buf), len(self._head))
            buf[:n], self._head = self._head[:n], self._head[n:]
            return n
        return self._conn.recv_into(buf)


def _router(fn: str) -> RewardRouter:
    """The router of `--fn`; its errors name the flag (the router names config keys: `rewards.sources.*`)."""
    try:
        return RewardRouter({"*": fn})
    except RewardError as e:
        raise RewardError(f"--fn {fn}: {str(e).removeprefix(_SETTING)}") from e


_SETTING = "rewards.sources.*: "


def serve(opts: ServeOptions) -> None:
    """Runs the server until interrupted (the `fleetrl serve-reward` command)."""
    server = RewardServer(opts)
    log.warning("serving %s at %s%s", server.spec, server.url, " (token required)" if opts.token else "")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()


def parse_body(raw: bytes) -> Any:
    """The request body's JSON; ValueError (a 400) when it is not JSON or nests deeper than MAX_JSON_DEPTH."""
    try:
        body = json.loads(raw)
    except RecursionError:  # the C parser recurses per level: ~1000 levels exhaust it (and killed the handler)
        body, too_deep = None, True
    else:
        too_deep = _deeper_than(body, MAX_JSON_DEPTH)
    if too_deep:  # one limit for both: bodies between MAX_JSON_DEPTH and the parser's limit would be accepted
        raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels; no field needs that: send flatter "
                         f"ground_truths and extra_infos")
    return body


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether containers nest more than `limit` deep in `value` (walked with a stack: no recursion to exhaust)."""
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


_RESPONSES_FIX = 'send the texts to score, e.g. "responses": ["The answer is 4.", ...]'
# Per field: (what one entry must be, whether an entry is that, how to fix it). ground_truths entries may be any
# JSON (the scorer reads them). Each check matches what the runner, router or reward model does with an entry.
_ENTRY_RULES: dict[str, tuple[str, Callable[[Any], bool], str]] = {
    "responses": ("a string (the response text)", lambda v: isinstance(v, str), _RESPONSES_FIX),
    "ground_truths": ("", lambda v: True,
                      'send one per response, e.g. "ground_truths": ["4", ...], or leave the field out'),
    "data_sources": ("a string (the data source name)", lambda v: isinstance(v, str),
                     'send one name per response, e.g. "data_sources": ["math", ...], or leave the field out'),
    "extra_infos": ("a JSON object or null", lambda v: v is None or isinstance(v, dict),
                    'send one object per response, e.g. "extra_infos": [{"split": "train"}, ...], or leave the '
                    'field out'),
    "prompts": ("a string or a list of chat messages (JSON objects)",
                lambda v: isinstance(v, str) or (isinstance(v, list) and all(isinstance(m, dict) for m in v)),
                'send one per response, e.g. "prompts": ["What is 2+2?", ...] or [[{"role": "user", "content": '
                '"What is 2+2?"}], ...]'),
}
_DEFAULTS: dict[str, Any] = {"ground_truths": None, "data_sources": "remote", "extra_infos": None}


def validate_batch(batch: Any) -> dict[str, list]:
    """The request body as four equal-length lists (ground_truths, data_sources, extra_infos may be omitted or
    null), plus `prompts` when sent. ValueError (a 400) names the field, what it must be and how to fix it:
    a wrongly typed entry used to reach the router or a scorer and come back as a 500 or a silent error score."""
    if not isinstance(batch, dict):
        raise ValueError(f'the body must be a JSON object, got {_described(batch)}; send e.g. '
                         f'{{"responses": ["The answer is 4."], "ground_truths": ["4"]}}')
    if "responses" not in batch:
        raise ValueError(f'the body has no "responses"; {_RESPONSES_FIX}')
    n = len(batch["responses"]) if isinstance(batch["responses"], list) else 0  # else the loop's first check fails
    out: dict[str, list] = {}
    for field in (*FIELDS, "prompts"):  # FIELDS starts with responses: n is checked before it is used
        value = batch.get(field)
        if value is None and field in _DEFAULTS:
            out[field] = [_DEFAULTS[field]] * n
            continue
        if value is None and field == "prompts":
            continue
        expected, ok, fix = _ENTRY_RULES[field]
        if not isinstance(value, list):
            raise ValueError(f"{field} must be an array with one entry per response, got {_described(value)}; {fix}")
        if len(value) != n:
            raise ValueError(f"{field} has length {len(value)} but responses has length {n}; {fix}")
        for i, entry in enumerate(value):
            if not ok(entry):
                raise ValueError(f"{field}[{i}] must be {expected}, got {_described(entry)}; {fix}")
        out[field] = value
    out["extra_infos"] = [e or {} for e in out["extra_infos"]]
    return out


def _described(value: Any) -> str:
    """A JSON value as an error message shows it: its JSON type and (shortened) text, e.g. `an array ["x"]`."""
    if value is None:
        return "null"
    kind = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}.get(type(value), "a number")
    text = json.dumps(value)
    return f"{kind} {text if len(text) <= 40 else text[:37] + '...'}"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _handler_for(server: RewardServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            conn, head = self.request
            self.request = self.connection = conn
            self.rfile = io.BufferedReader(_Prefixed(head, conn))
            self.wfile = conn.makefile("wb", buffering=0)

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming); GET /health never gets here: _answer_health
            if self._authorized():
                self._reply(404, {"error": f"no route GET {self.path}; use GET /health or POST /score"})

        def do_POST(self) -> None:  # noqa: N802
            if not self._authorized():
                return
            if self.path.rstrip("/") != "/score":
                return self._reply(404, {"error": f"no route POST {self.path}; use POST /score"})
            length = self.headers.get("Content-Length")
            if length is None or not length.isdigit():
                return self._reply(411, {"error": "Content-Length required"})
            if int(length) > server.opts.max_body_bytes:
                return self._reply(413, {"error": f"body of {length} bytes exceeds the server's limit of "
                                                  f"{server.opts.max_body_bytes}; send smaller batches or "
                                                  f"restart it with a larger --max-body-bytes"})
            try:
                batch = validate_batch(parse_body(self.rfile.read(int(length))))
            except (ValueError, UnicodeDecodeError) as e:
                return self._reply(400, {"error": f"bad request: {e}"})
            if server.rm is not None and "prompts" not in batch:
                return self._reply(400, {"error": "bad request: this server hosts a reward model, which scores "
                                                  "(prompt, response): send 'prompts' (one per response)"})
            try:
                scored = server.score(batch)
            except Exception as e:  # the runner counts scorer failures; this is anything else
                log.exception("scoring failed")
                return self._reply(500, {"error": f"{type(e).__name__}: {e}"})
            self._reply(200, scored)

        def _authorized(self) -> bool:
            # http.client decodes header values as latin-1: encoding back gives the bytes the client sent.
            if server._token_ok(self.headers.get("Authorization", "").encode("latin-1")):
                return True
            self._reply(401, _UNAUTHORIZED, {"WWW-Authenticate": "Bearer"})
            return False

        def _reply(self, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
            data = json.dumps(body).encode()
            self.close_connection = True  # one request per connection: the next one goes through the gate again
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Connection", "close")
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):  # the client timed out and left; nothing to tell
                self.close_connection = True
                log.debug("client %s left before the reply", self.address_string())

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            log.debug("%s " + format, self.address_string(), *args)

    return Handler
