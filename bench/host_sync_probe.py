"""Which host calls of the fast engine's overlapped work wait for the GPU (bench/RESULTS.md, tenth round).

The engine queues decode steps and then does its host work (release, compaction, prefill) while they run
(engines/fast/engine.py `_run`). A call that waits for the stream there serialises the two. This probe queues
~50 ms of GPU sleep, then times each call on the host: ~0.1 ms means it was queued, ~50 ms means it waited.

    PYTHONPATH=. python bench/host_sync_probe.py [--out DIR]     (CUDA only)
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import device_info, out_dir, write_json  # noqa: E402
from fleetrl.batch import upload  # noqa: E402
from fleetrl.engines.fast.arch import DecoderSpec  # noqa: E402
from fleetrl.engines.fast.state import SlotBuffers, device_index  # noqa: E402

SLEEP_CYCLES = 100_000_000  # torch.cuda._sleep spins this many GPU clock cycles: ~50 ms at ~2 GHz


def host_ms(fn: Callable[[], object], repeats: int = 3) -> float:
    """The host time of fn() with the GPU busy for ~50 ms: the last of `repeats` tries, in ms."""
    for _ in range(repeats):
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        t0 = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - t0
        torch.cuda.synchronize()
    return 1e3 * elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    spec = DecoderSpec(num_layers=2, hidden=128, num_heads=2, num_kv_heads=2, head_dim=64, vocab=10, rms_eps=1e-6)
    buf = SlotBuffers.allocate(spec, 256, 64, torch.bfloat16, dev)
    buf.lead.copy_(torch.arange(256, device=dev) // 8 * 8)  # groups of 8 led by their first slot
    slots = list(range(3, 90, 3))  # 29 released slots
    index = device_index(slots, dev)
    mask = torch.zeros(256, dtype=torch.bool, device=dev)
    calls: dict[str, Callable[[], object]] = {
        "nothing (the sleep alone)": lambda: None,
        "device_index (pinned, non-blocking)": lambda: device_index(slots, dev),
        "upload of a CPU tensor": lambda: upload(torch.arange(30), dev),
        "torch.zeros on the GPU": lambda: torch.zeros(256, dtype=torch.bool, device=dev),
        "mask[index] = True": lambda: mask.__setitem__(index, True),
        "mask.index_fill_(0, index, True)": lambda: mask.index_fill_(0, index, True),
        "mask[lead] (gather)": lambda: mask[buf.lead],
        "torch.isin(lead, 29 values)": lambda: torch.isin(buf.lead, index),
        "torch.isin(lead, 10 values)": lambda: torch.isin(buf.lead, index[:10]),
        "SlotBuffers.release (29 slots)": lambda: buf.release(device_index(slots, dev)),
    }
    rows = [{"call": name, "host_ms": host_ms(fn)} for name, fn in calls.items()]
    for row in rows:
        print(f"{row['call']:40s} {row['host_ms']:8.2f} ms on the host", flush=True)
    write_json(out_dir(args.out) / "host_sync_probe.json", {"info": device_info("cuda"), "rows": rows})


if __name__ == "__main__":
    main()
