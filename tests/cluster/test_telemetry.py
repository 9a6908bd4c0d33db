"""Worker-call telemetry (cluster/telemetry.py): per-rank seconds, Ray overhead, bytes through the driver."""
from __future__ import annotations

import pickle

import numpy as np
import torch

from fleetrl.batch import Batch
from fleetrl.cluster.telemetry import CallStats, payload_bytes


def test_payload_bytes_counts_tensor_storage_and_pickled_fields_only():
    b = Batch({"x": torch.zeros(4, 3, dtype=torch.int64), "m": torch.ones(4, dtype=torch.bool)},
              {"src": np.array(["a", "b", "c", "d"], dtype=object)})
    fields = len(pickle.dumps(b.fields, protocol=pickle.HIGHEST_PROTOCOL))
    assert payload_bytes(b) == 4 * 3 * 8 + 4 * 1 + fields
    assert payload_bytes([b, b]) == 2 * payload_bytes(b)
    assert payload_bytes(3.5) == payload_bytes("generate") == 0  # scalars and messages are not data


def test_call_stats_report_rank_skew_overhead_and_bytes():
    stats = CallStats("main")
    part = Batch({"x": torch.zeros(2, 5, dtype=torch.float32)})  # 40 bytes
    # Two generate calls of a 3-rank pool: per rank 1+2, 3+1, 2+2 = 3, 4, 4 s; the second call's wall 2.5 s
    # against its slowest rank's 2 s is 0.5 s of Ray overhead, the first's 3.5 - 3 = 0.5 s more.
    stats.record("generate", [1.0, 3.0, 2.0], 3.5, [part] * 3, [part] * 3)
    stats.record("generate", [2.0, 1.0, 2.0], 2.5, [part] * 3, [])
    assert stats.take_overhead() == 1.0 and stats.take_overhead() == 0.0
    m = stats.take()
    assert m["driver/bytes_out/main"] == 6 * 40 and m["driver/bytes_in/main"] == 3 * 40
    assert (m["time/rank/main/generate/min"], m["time/rank/main/generate/median"],
            m["time/rank/main/generate/max"], m["time/rank/main/generate/max_rank"]) == (3.0, 4.0, 4.0, 1.0)
    assert stats.take() == {"driver/bytes_out/main": 0.0, "driver/bytes_in/main": 0.0}  # a new step starts empty


def test_one_rank_pools_report_no_skew():
    stats = CallStats("gen")
    stats.record("generate", [2.0], 2.0, [], [])
    assert not any(k.startswith("time/rank") for k in stats.take())
