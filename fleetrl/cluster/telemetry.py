"""What a step's worker calls cost, as the controller sees them: each rank's own seconds per verb (rank skew),
Ray's share of the wall time (serialisation, scheduling, transfer), and the bytes that pass through the driver.

Why: a mean over ranks hides the slowest rank, which is the one every collective waits for, and the bytes through
the driver are the measure of "the controller moves references and scalars, not per-sample tensors".
"""
from __future__ import annotations

import pickle
import statistics
from dataclasses import dataclass, field
from typing import Any

from fleetrl.batch import Batch


def payload_bytes(obj: Any) -> int:
    """Bytes of the per-sample data in `obj` (a Batch, or a list/tuple of them): tensors by their storage size,
    per-sample Python fields by their pickled size. Scalars and typed messages count 0: they are not data."""
    if isinstance(obj, Batch):
        fields = len(pickle.dumps(obj.fields, protocol=pickle.HIGHEST_PROTOCOL)) if obj.fields else 0
        return sum(t.numel() * t.element_size() for t in obj.tensors.values()) + fields
    if isinstance(obj, (list, tuple)):
        return sum(payload_bytes(x) for x in obj)
    return 0


@dataclass
class CallStats:
    """Accumulates one step's calls of one pool; `take()` returns its metrics and starts over."""
    pool: str
    overhead_s: float = 0.0
    bytes_out: int = 0
    bytes_in: int = 0
    rank_s: dict[str, list[float]] = field(default_factory=dict)
    """verb -> per-rank seconds inside the worker, summed over the step's calls of that verb."""

    def record(self, verb: str, per_rank_s: list[float], wall_s: float, sent: Any, received: Any) -> None:
        self.overhead_s += max(0.0, wall_s - max(per_rank_s))
        self.bytes_out += payload_bytes(sent)
        self.bytes_in += payload_bytes(received)
        total = self.rank_s.setdefault(verb, [])
        total += [0.0] * (len(per_rank_s) - len(total))  # a group rebuilt at another size (fallback) mid-step
        for r, s in enumerate(per_rank_s):
            total[r] += s

    def take_overhead(self) -> float:
        spent, self.overhead_s = self.overhead_s, 0.0
        return spent

    def take(self) -> dict[str, float]:
        """Per verb with more than one rank: min / median / max seconds and which rank was slowest; the bytes the
        driver sent and received for this pool."""
        out = {f"driver/bytes_out/{self.pool}": float(self.bytes_out),
               f"driver/bytes_in/{self.pool}": float(self.bytes_in)}
        for verb, per_rank in self.rank_s.items():
            if len(per_rank) < 2:
                continue
            key = f"time/rank/{self.pool}/{verb}"
            slowest = max(range(len(per_rank)), key=per_rank.__getitem__)
            out.update({f"{key}/min": min(per_rank), f"{key}/median": statistics.median(per_rank),
                        f"{key}/max": per_rank[slowest], f"{key}/max_rank": float(slowest)})
        self.bytes_out = self.bytes_in = 0
        self.rank_s = {}
        return out
