"""`fleetrl serve-reward`: a scorer behind HTTP, for rewards that need their own machine or environment.

    GET  /health -> {"status": "ok", "scorer": SPEC}
    POST /score  {"responses": [...], "ground_truths": [...], "data_sources": [...], "extra_infos": [...]}
              -> {"scores": [...], "num_errors": N, "num_timeouts": N, "errors": [...]}

Scoring goes through the same RewardRunner as local rewards, so a stuck or crashing scorer costs one
sample's default score, never a hung request. Every route needs `Authorization: Bearer TOKEN` when a token
is set, and a token is mandatory whenever the server listens beyond loopback. Bodies above
`max_body_bytes` are refused with 413 before they are read.
"""
from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from fleetrl.rewards.registry import RewardRouter
from fleetrl.rewards.runner import RewardRunner

log = logging.getLogger("fleetrl.rewards.server")
FIELDS = ("responses", "ground_truths", "data_sources", "extra_infos")


@dataclass(frozen=True, kw_only=True, slots=True)
class ServeOptions:
    fn: str
    """Scorer spec: `path/to/file.py:fn` or a builtin name; it scores every data source."""
    host: str = "127.0.0.1"
    port: int = 8000
    token: str | None = None
    max_body_bytes: int = 64 * 2**20
    timeout_s: float = 30.0
    """Per-sample limit inside the server; a sample over it gets default_score."""
    default_score: float = 0.0
    num_workers: int = 8


class RewardServer:
    """A ThreadingHTTPServer serving one scorer; `serve_forever()` blocks, `close()` stops it."""

    def __init__(self, opts: ServeOptions) -> None:
        if not opts.token and not _is_loopback(opts.host):
            raise ValueError(f"--host {opts.host} exposes the reward server beyond this machine; pass --token "
                             f"SECRET (clients send it as a Bearer token) or bind --host 127.0.0.1")
        # "*" routes every data source to this scorer (family defaults like "math" never apply).
        self.runner = RewardRunner(RewardRouter({"*": opts.fn}), timeout_s=opts.timeout_s,
                                   default_score=opts.default_score, num_workers=opts.num_workers)
        self.opts = opts
        self._lock = threading.Lock()  # one batch at a time through the runner; a batch runs in parallel
        self.httpd = ThreadingHTTPServer((opts.host, opts.port), _handler_for(self))
        self.httpd.daemon_threads = True

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def serve_forever(self) -> None:
        self.httpd.serve_forever(poll_interval=0.2)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.runner.close()

    def score(self, batch: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            result = self.runner.score(*(batch[k] for k in FIELDS))
        return {"scores": result.scores, "num_errors": result.num_errors, "num_timeouts": result.num_timeouts,
                "num_skipped": result.num_skipped, "errors": result.errors, "scorer": self.opts.fn}


def serve(opts: ServeOptions) -> None:
    """Runs the server until interrupted (the `fleetrl serve-reward` command)."""
    server = RewardServer(opts)
    log.warning("serving %s at %s%s", opts.fn, server.url, " (token required)" if opts.token else "")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()


def validate_batch(batch: Any) -> dict[str, list]:
    """The request body as four equal-length lists (extra_infos and data_sources may be omitted)."""
    if not isinstance(batch, dict) or not isinstance(batch.get("responses"), list):
        raise ValueError("body must be a JSON object with a list 'responses' (and ground_truths, data_sources, "
                         "extra_infos of the same length)")
    n = len(batch["responses"])
    out = {"responses": batch["responses"], "ground_truths": batch.get("ground_truths", [None] * n),
           "data_sources": batch.get("data_sources", ["remote"] * n),
           "extra_infos": batch.get("extra_infos", [{}] * n)}
    lengths = {k: len(v) if isinstance(v, list) else None for k, v in out.items()}
    if set(lengths.values()) != {n}:
        raise ValueError(f"fields must be lists of equal length; got {lengths}")
    out["extra_infos"] = [e or {} for e in out["extra_infos"]]
    return out


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

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self._authorized():
                if self.path.rstrip("/") == "/health":
                    self._reply(200, {"status": "ok", "scorer": server.opts.fn})
                else:
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
                batch = validate_batch(json.loads(self.rfile.read(int(length))))
            except (ValueError, UnicodeDecodeError) as e:
                return self._reply(400, {"error": f"bad request: {e}"})
            try:
                scored = server.score(batch)
            except Exception as e:  # the runner counts scorer failures; this is anything else
                log.exception("scoring failed")
                return self._reply(500, {"error": f"{type(e).__name__}: {e}"})
            self._reply(200, scored)

        def _authorized(self) -> bool:
            token = server.opts.token
            if not token:
                return True
            given = self.headers.get("Authorization", "")
            if hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                return True
            self._reply(401, {"error": "missing or wrong bearer token; clients pass the server's --token "
                                       "(rewards.remote_token)"}, {"WWW-Authenticate": "Bearer"})
            return False

        def _reply(self, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
            data = json.dumps(body).encode()
            if status != 200:
                self.close_connection = True  # a body we refused to read must not be parsed as a request
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
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
