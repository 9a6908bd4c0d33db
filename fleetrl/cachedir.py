"""Where fleetrl keeps what it can rebuild but would rather not rebuild at every start: converted tokenizers, GGUF
models dequantised to float (models/gguf_cache.py) and the compile caches of torch.compile (Inductor) and Triton.

`FLEETRL_CACHE_DIR` names the directory; by default `$XDG_CACHE_HOME/fleetrl` (`~/.cache/fleetrl`). Everything in it
may be deleted at any time.
"""
from __future__ import annotations

import os
import socket
from pathlib import Path


def user_cache_dir(*parts: str) -> Path:
    """`FLEETRL_CACHE_DIR` (default `$XDG_CACHE_HOME/fleetrl`) / parts; not created."""
    root = os.environ.get("FLEETRL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "fleetrl")
    return Path(root, *parts)


def use_node_compile_cache() -> dict[str, str]:
    """Points Inductor's and Triton's caches of this process at one directory per node (host name) under the user
    cache dir, unless the environment already names them (cluster.env may). Returns the variables it set.

    Why: every worker of a node compiles the same graphs; in one cache a rank (or the next run) loads what another
    compiled instead of compiling it again. Per node, since a cache dir on a shared home directory would otherwise be
    written by every node's ranks at once. Call before the process's first compile: Inductor reads the variable on
    first use and Triton on each compile."""
    root = user_cache_dir("compile", socket.gethostname())
    wanted = {"TORCHINDUCTOR_CACHE_DIR": root / "inductor", "TRITON_CACHE_DIR": root / "triton"}
    set_now = {k: str(v) for k, v in wanted.items() if not os.environ.get(k)}
    for key, path in set_now.items():
        os.makedirs(path, exist_ok=True)
        os.environ[key] = path
    return set_now
