"""The decode attention kernel alone (issue 14): device time per layer against the KV bytes it must read, over
launch configurations (positions per tile, warps, pipeline stages, splits of the cache span).

  PYTHONPATH=. python bench/decode_attn.py --out $OUT [--shapes qwen2.5-0.5b,qwen2.5-1.5b] [--batch 256]

The kernel runs as the folded decode calls it (engines/fast/forward.py `_decode_folded`): q/k/v as column views
of one fused GEMM output, the row's 1/rms and the bias applied inside, RoPE, the cache write at the new position.
One distinct cache per layer (L of them, more than the L2 cache holds), the L calls captured in one CUDA graph and
replayed, so a figure is device time with the in-graph launch gap and no host time. Every slot sits at the same
position, as in the fixed-length decode; the figure is the mean over three positions spread over the decode of a
128-token prompt and 256 new tokens. `group` 8 gives each prompt's 8 samples one leader whose cached prompt rows
they read (GRPO's shared prompts); the floor counts those rows once. Every configuration's output is compared
with the engine's own launch (the first row of each shape and group).
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import copy_bandwidth, device_info, out_dir, print_table, write_json  # noqa: E402
from bench.decode_gemm import graph_time  # noqa: E402
from fleetrl.engines.fast import triton_kernels as tk  # noqa: E402
from fleetrl.engines.fast.arch import DecoderSpec  # noqa: E402
from fleetrl.models.shapes import QWEN25  # noqa: E402

PROMPT, NEW = 128, 256
POSITIONS = (PROMPT + 32, PROMPT + 128, PROMPT + 224)
LAUNCH, BLOCK_N = dict(tk.ATTN_LAUNCH), tk.ATTN_BLOCK_N  # the engine's own, restored after each shape


def spec_of(shape: str) -> DecoderSpec:
    d = QWEN25[shape]
    heads = d["num_attention_heads"]
    return DecoderSpec(num_layers=d["num_hidden_layers"], hidden=d["hidden_size"], num_heads=heads,
                       num_kv_heads=d["num_key_value_heads"], head_dim=d["hidden_size"] // heads, vocab=151936,
                       rms_eps=1e-6)


class Case:
    """Inputs of one shape at one batch: L layers of caches, the fused q/k/v rows, the residual rows."""

    def __init__(self, shape: str, nb: int, dev: str = "cuda") -> None:
        s, dt = spec_of(shape), torch.bfloat16
        self.shape, self.spec, self.nb, max_len = shape, s, nb, PROMPT + NEW
        kv_shape = (s.num_layers, nb, s.num_kv_heads, max_len, s.head_dim)
        self.kc, self.vc = torch.randn(kv_shape, device=dev, dtype=dt), torch.randn(kv_shape, device=dev, dtype=dt)
        width = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
        self.qkv = torch.randn(nb, width, device=dev, dtype=dt)
        self.x = torch.randn(nb, s.hidden, device=dev, dtype=dt)
        self.bias = torch.randn(width, device=dev, dtype=dt) * 0.1
        # RoPE's values do not change the kernel's work (bench/decode.py --profile times it on random tables too)
        self.cos, self.sin = (torch.rand(max_len, s.head_dim, device=dev, dtype=dt) for _ in range(2))
        self.pos = torch.zeros(nb, device=dev, dtype=torch.long)
        self.lead, self.shared = torch.arange(nb, device=dev), torch.zeros(nb, device=dev, dtype=torch.long)

    def set(self, position: int, group: int) -> None:
        self.pos.fill_(position)
        self.lead.copy_(torch.arange(self.nb, device=self.lead.device) // group * group)
        self.shared.fill_(PROMPT if group > 1 else 0)

    def call(self, kern: tk.TritonKernels, layer: int) -> torch.Tensor:
        s = self.spec
        hq, hk = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        q, k, v = self.qkv[:, :hq], self.qkv[:, hq:hq + hk], self.qkv[:, hq + hk:]
        return kern.decode_attention(q, k, v, self.cos, self.sin, self.pos, self.kc[layer], self.vc[layer], s,
                                     s.head_dim ** -0.5, self.lead, self.shared, norm_of=self.x, bias=self.bias)

    def floor_bytes(self, position: int, group: int) -> int:
        """KV bytes one layer must read: each slot's own rows, a group's prompt rows once."""
        s = self.spec
        rows = self.nb * (position + 1) if group == 1 else \
            self.nb // group * PROMPT + self.nb * (position + 1 - PROMPT)
        return rows * s.num_kv_heads * s.head_dim * 2 * 2


def configure(kern: tk.TritonKernels, head_dim: int, cfg: tuple[int, int, int, int] | None) -> None:
    """cfg: (positions per tile, warps, stages, splits; 0 = the launcher's rule), None = the engine's own launch."""
    block_n, warps, stages, nsplit = cfg or (BLOCK_N, 0, 0, 0)
    tk.ATTN_BLOCK_N = block_n
    tk.ATTN_LAUNCH = {**LAUNCH, head_dim: (warps, stages)} if cfg else dict(LAUNCH)
    if nsplit:  # force the split count; otherwise the launcher's own rule (tk.TritonKernels.attention_splits)
        def splits(nb: int, kv_heads: int, max_len: int) -> tuple[int, int]:
            per = tk.triton.cdiv(tk.triton.cdiv(max_len, nsplit), block_n) * block_n
            return tk.triton.cdiv(max_len, per), per
        kern.attention_splits = splits
    else:
        kern.__dict__.pop("attention_splits", None)


def time_config(case: Case, kern: tk.TritonKernels, cfg: tuple[int, int, int, int] | None, group: int,
                refs: dict[int, torch.Tensor], copy_bps: float) -> dict:
    """One row: the mean µs per layer over POSITIONS, the floor, and the largest output difference from `refs`
    (the engine's launch, filled in when cfg is None)."""
    configure(kern, case.spec.head_dim, cfg)
    times, err = [], 0.0
    for p in POSITIONS:
        case.set(p, group)
        out = case.call(kern, 0).float()
        refs.setdefault(p, out)
        err = max(err, (out - refs[p]).abs().max().item())
        times.append(graph_time([lambda i=i: case.call(kern, i) for i in range(case.spec.num_layers)]))
    us = sum(times) / len(times) * 1e6
    floor = sum(case.floor_bytes(p, group) for p in POSITIONS) / len(POSITIONS) / copy_bps * 1e6
    block_n, warps, stages, nsplit = cfg or (BLOCK_N, "engine", "engine", 0)
    return dict(shape=case.shape, batch=case.nb, group=group, block_n=block_n, warps=warps, stages=stages,
                splits=nsplit or "auto", us=round(us, 2), floor_us=round(floor, 2), of_floor=round(floor / us, 3),
                max_abs_diff=float(f"{err:.2e}"))


def sweep(shape: str, nb: int, copy_bps: float) -> list[dict]:
    case, kern, rows = Case(shape, nb), tk.TritonKernels(torch.device("cuda")), []
    configs = [None] + [c + (0,) for c in itertools.product((32, 64), (2, 4, 8), (1, 2, 3, 4))] + \
        [(64, 4, 3, 2), (32, 4, 3, 2), (64, 4, 3, 4)]
    try:
        for group in (1, 8):
            refs: dict[int, torch.Tensor] = {}  # configs[0] (the engine's launch) fills it
            for cfg in configs:
                rows.append(time_config(case, kern, cfg, group, refs, copy_bps))
                print(rows[-1], flush=True)
    finally:
        configure(kern, case.spec.head_dim, None)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", default="qwen2.5-0.5b,qwen2.5-1.5b")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out, copy_bps, rows = out_dir(args.out), copy_bandwidth("cuda"), []
    for shape in args.shapes.split(","):
        rows += sweep(shape, args.batch, copy_bps)
        write_json(out / "decode_attn.json", {"device": device_info("cuda"), "copy_GBps": copy_bps / 1e9, "rows": rows})
    best = {}
    for r in rows:
        key = (r["shape"], r["group"])
        best[key] = min(best.get(key, r), r, key=lambda x: x["us"])
    print_table(rows, ["shape", "group", "block_n", "warps", "stages", "splits", "us", "floor_us", "of_floor",
                       "max_abs_diff"])
    print("best:", *best.values(), sep="\n")


if __name__ == "__main__":
    main()
