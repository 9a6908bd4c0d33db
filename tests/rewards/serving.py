"""A `fleetrl serve-reward` server on a free port in a thread, for tests: `with serving(fn=...) as server`."""
from __future__ import annotations

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
