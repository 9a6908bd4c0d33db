"""The async weight path's publish and fetch through Ray's object store: a state of `--gb` GB in bf16, put and got
as torch tensors (in-band pickling) and as `cluster/store_codec.py` arrays (out of band), in one process on a
local Ray cluster. Prints one JSON object, also written to `--out` (else $OUT, else bench_out/).

    python bench/store_codec.py --gb 2
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fleetrl.cluster.store_codec import from_store, to_store  # noqa: E402


def _timed(state: dict, encode, decode) -> dict[str, float]:
    t0 = time.perf_counter()
    ref = ray.put(encode(state))
    t1 = time.perf_counter()
    got = decode(ray.get(ref))
    t2 = time.perf_counter()
    assert all(torch.equal(got[k], v) for k, v in list(state.items())[:2]), "the round trip changed the weights"
    del got, ref
    return {"put_s": t1 - t0, "get_s": t2 - t1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=2.0, help="size of the state (bf16 matrices of 4096 x 2048)")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = ap.parse_args()
    n = max(1, round(args.gb * 1e9 / (4096 * 2048 * 2)))
    state = {f"layer{i}.weight": torch.randn(4096, 2048).to(torch.bfloat16) for i in range(n)}
    gb = n * 4096 * 2048 * 2 / 1e9
    ray.init(address="local", include_dashboard=False, object_store_memory=int(max(4e9, 3 * gb * 1e9)))
    try:
        rows = {"tensors": _timed(state, lambda s: s, lambda s: s),
                "arrays": _timed(state, to_store, from_store)}
    finally:
        ray.shutdown()
    for r in rows.values():
        r.update(put_gb_per_s=gb / r["put_s"], get_gb_per_s=gb / r["get_s"])
    result = {"bench": "store_codec", "gb": gb, "date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), **rows}
    print(json.dumps(result))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "store_codec.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
