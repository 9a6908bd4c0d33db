"""Which logged metrics measure the machine rather than the learning.

Two runs with the same seed log the same learning numbers bit for bit (on CPU), but never the same timings or
memory peaks; every check that two runs agree (reports, resume and determinism tests) leaves these out through
this one predicate. Its own module, free of torch, because `fleetrl report` reads it and must start fast.
"""
from __future__ import annotations

# Substrings of the names: train/time/* and val/time/* (worker_call_overhead among them), the throughput, and
# the workers' memory peaks (workers/memory.py).
# train/driver/bytes_* measure the data path (rank-local or through the controller), not the learning.
MACHINE_MARKERS = ("time/", "tokens_per_s", "worker_call_overhead", "memory/", "driver/bytes")
# Seconds elsewhere in the tree end in "_s": the environments' tool and wait times (train/env/tool_time_s,
# env_wait_s) and the async pipeline's waits (async/actor_wait_s, rollout_busy_s, rollout_idle_s).
SECONDS_SUFFIX = "_s"


def is_machine_metric(name: str) -> bool:
    """True for a metric that differs between two runs of the same seed: e.g. "train/time/step",
    "train/tokens_per_s", "train/memory/rss_peak_gib", "async/actor_wait_s"; False for "train/actor/pg_loss"."""
    return name.endswith(SECONDS_SUFFIX) or any(m in name for m in MACHINE_MARKERS)
