"""A `fleetrl serve-reward` server on a free port in a thread, for tests: `with serving(fn=...) as server`; and a URL
where no server answers: `with refusing_url() as url`."""
from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from fleetrl.rewards.server import RewardServer, ServeOptions


@contextmanager
def serving(**kw: object) -> Iterator[RewardServer]:
    server = RewardServer(ServeOptions(port=0, **kw))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.close()
        thread.join(timeout=10)


@contextmanager
def refusing_url() -> Iterator[str]:
    """A loopback URL that refuses connections while the block runs: its port is bound and never listens, so no
    other process (pytest -n) can start listening there meanwhile, as it could on a port found free and closed."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
