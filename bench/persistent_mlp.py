"""A persistent Triton kernel for the second half of a folded decode layer, against the cuBLAS chain it replaces.

  PYTHONPATH=. python bench/persistent_mlp.py --out $OUT [--shapes qwen2.5-0.5b,qwen2.5-1.5b] [--rows 16,64]

The question (bench/RESULTS.md, twelfth round): a decode step at small batch is ~150-175 kernels at a fixed
~3-5 µs each, far above the weight reads. Does one launch that runs several phases, separated by grid-wide
barriers, beat the separate launches? The phases are the engine's `_decode_folded` after the attention:

  3  x += o @ Wo^T                                  (tiles over hidden)
  4  act = silu(g) * u, [g u] = rstd(x) * (x @ Wgu^T) + b   (tiles over intermediate; 1/rms from the loads)
  5  part[s] = act[:, Ks] @ Wd[:, Ks]^T             (split-K: tiles over hidden x S slices, fp32 partials)
  6  x += sum_s part[s]                             (fixed order: deterministic)

The chain it is timed against is the engine's: addmm_ (o), mm (gate/up), silu_mul, addmm_ (down). Both run for
every layer with its own weights (24 or 28 copies, more than L2 holds), captured in one CUDA graph.
The grid is one program per SM, so all programs are resident and the spin barrier cannot deadlock. On CPU
(TRITON_INTERPRET=1) the programs run one after another, so there each phase is a launch of its own
(FIRST = LAST); the test in tests/bench checks those phases against torch.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {"qwen2.5-0.5b": (896, 896, 4864, 24), "qwen2.5-1.5b": (1536, 1536, 8960, 28)}  # hidden, q, inter, L


@triton.jit
def _grid_barrier(bar_ptr, target):
    """Every program adds 1, then waits until all have: a release/acquire pair at GPU scope, so each program's
    stores before it are seen by every program's loads after it. `target` = phase number x programs."""
    tl.debug_barrier()
    tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
    while tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu") < target:
        pass
    tl.debug_barrier()


@triton.jit
def _mlp_kernel(x_ptr, o_ptr, wo_ptr, wgu_ptr, bgu_ptr, wd_ptr, act_ptr, part_ptr, bar_ptr, M, eps,
                H: tl.constexpr, Q: tl.constexpr, INTER: tl.constexpr, MB: tl.constexpr, BK: tl.constexpr,
                BN3: tl.constexpr, BN4: tl.constexpr, BN5: tl.constexpr, S5: tl.constexpr, KS5: tl.constexpr,
                BN6: tl.constexpr, HAS_BIAS: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    rows = tl.arange(0, MB)
    rmask = rows < M
    ks = tl.arange(0, BK)
    if FIRST <= 3 and 3 <= LAST:  # x += o @ Wo^T
        for item in range(pid, tl.cdiv(H, BN3), nprog):
            n = item * BN3 + tl.arange(0, BN3)
            acc = tl.zeros((MB, BN3), tl.float32)
            for k0 in range(0, Q, BK):
                a = tl.load(o_ptr + rows[:, None] * Q + (k0 + ks)[None, :], mask=rmask[:, None], other=0.0)
                w = tl.load(wo_ptr + n[None, :] * Q + (k0 + ks)[:, None])
                acc = tl.dot(a, w, acc)
            xt = tl.load(x_ptr + rows[:, None] * H + n[None, :], mask=rmask[:, None], other=0.0)
            tl.store(x_ptr + rows[:, None] * H + n[None, :], (xt.to(tl.float32) + acc).to(xt.dtype),
                     mask=rmask[:, None])
        if LAST > 3:
            _grid_barrier(bar_ptr, 1 * nprog)
    if FIRST <= 4 and 4 <= LAST:  # act = silu(gate) * up, gate/up from the folded GEMM on the raw residual
        for item in range(pid, tl.cdiv(INTER, BN4), nprog):
            n = item * BN4 + tl.arange(0, BN4)
            ag = tl.zeros((MB, BN4), tl.float32)
            au = tl.zeros((MB, BN4), tl.float32)
            ss = tl.zeros((MB,), tl.float32)
            for k0 in range(0, H, BK):
                a = tl.load(x_ptr + rows[:, None] * H + (k0 + ks)[None, :], mask=rmask[:, None], other=0.0,
                            cache_modifier=".cg")
                af = a.to(tl.float32)
                ss += tl.sum(af * af, axis=1)
                wg = tl.load(wgu_ptr + n[None, :] * H + (k0 + ks)[:, None])
                wu = tl.load(wgu_ptr + (INTER + n)[None, :] * H + (k0 + ks)[:, None])
                ag = tl.dot(a, wg, ag)
                au = tl.dot(a, wu, au)
            rstd = tl.rsqrt(ss / H + eps)[:, None]
            dt = act_ptr.dtype.element_ty
            # as the engine's chain rounds: GEMM output to the dtype, then * 1/rms (+ bias), rounded again
            g = ag.to(dt).to(tl.float32) * rstd
            u = au.to(dt).to(tl.float32) * rstd
            if HAS_BIAS:
                g += tl.load(bgu_ptr + n).to(tl.float32)[None, :]
                u += tl.load(bgu_ptr + INTER + n).to(tl.float32)[None, :]
            g = g.to(dt).to(tl.float32)
            u = u.to(dt).to(tl.float32)
            act = (g * tl.sigmoid(g)).to(dt).to(tl.float32) * u
            tl.store(act_ptr + rows[:, None] * INTER + n[None, :], act.to(dt), mask=rmask[:, None])
        if LAST > 4:
            _grid_barrier(bar_ptr, 2 * nprog)
    if FIRST <= 5 and 5 <= LAST:  # part[s] = act[:, slice s] @ Wd[:, slice s]^T
        n_tiles = tl.cdiv(H, BN5)
        for item in range(pid, n_tiles * S5, nprog):
            n = (item % n_tiles) * BN5 + tl.arange(0, BN5)
            s = item // n_tiles
            acc = tl.zeros((MB, BN5), tl.float32)
            for k0 in range(s * KS5, (s + 1) * KS5, BK):
                kk = k0 + ks
                kmask = kk < INTER
                a = tl.load(act_ptr + rows[:, None] * INTER + kk[None, :], mask=rmask[:, None] & kmask[None, :],
                            other=0.0, cache_modifier=".cg")
                w = tl.load(wd_ptr + n[None, :] * INTER + kk[:, None], mask=kmask[:, None], other=0.0)
                acc = tl.dot(a, w, acc)
            tl.store(part_ptr + (s * MB + rows[:, None]) * H + n[None, :], acc)
        if LAST > 5:
            _grid_barrier(bar_ptr, 3 * nprog)
    if FIRST <= 6 and 6 <= LAST:  # x += sum of the partials, in slice order
        for item in range(pid, tl.cdiv(H, BN6), nprog):
            n = item * BN6 + tl.arange(0, BN6)
            acc = tl.zeros((MB, BN6), tl.float32)
            for s in range(S5):
                acc += tl.load(part_ptr + (s * MB + rows[:, None]) * H + n[None, :], cache_modifier=".cg")
            xt = tl.load(x_ptr + rows[:, None] * H + n[None, :], mask=rmask[:, None], other=0.0,
                         cache_modifier=".cg")
            tl.store(x_ptr + rows[:, None] * H + n[None, :], (xt.to(tl.float32) + acc).to(xt.dtype),
                     mask=rmask[:, None])


class PersistentMLP:
    """Launcher with its scratch buffers (fixed addresses, so the launch can be captured in a CUDA graph)."""

    def __init__(self, rows: int, hidden: int, inter: int, device: torch.device, dtype: torch.dtype,
                 programs: int, splits: int = 8, bk: int = 64) -> None:
        self.rows, self.hidden, self.inter, self.programs, self.splits, self.bk = rows, hidden, inter, programs, \
            splits, bk
        self.mb = max(16, triton.next_power_of_2(rows))
        self.ks = triton.cdiv(triton.cdiv(inter, splits), bk) * bk
        self.act = torch.empty(rows, inter, device=device, dtype=dtype)
        self.part = torch.zeros(splits, self.mb, hidden, device=device, dtype=torch.float32)
        self.bar = torch.zeros(1, device=device, dtype=torch.int32)

    def __call__(self, x: torch.Tensor, o: torch.Tensor, wo: torch.Tensor, wgu: torch.Tensor,
                 bgu: torch.Tensor | None, wd: torch.Tensor, eps: float, phases: tuple[int, int] = (3, 6),
                 bn: tuple[int, int, int, int] = (16, 32, 64, 64), warps: int = 4, stages: int = 3) -> None:
        assert x.shape == (self.rows, self.hidden) and x.is_contiguous() and o.is_contiguous()
        assert self.hidden % self.bk == 0 and o.shape[1] % self.bk == 0, "phases 3 and 4 read K in whole BK tiles"
        self.bar.zero_()
        _mlp_kernel[(self.programs,)](
            x, o, wo, wgu, bgu if bgu is not None else wgu, wd, self.act, self.part, self.bar, self.rows, eps,
            H=self.hidden, Q=o.shape[1], INTER=self.inter, MB=self.mb, BK=self.bk, BN3=bn[0], BN4=bn[1], BN5=bn[2],
            S5=self.splits, KS5=self.ks, BN6=bn[3], HAS_BIAS=bgu is not None, FIRST=phases[0], LAST=phases[1],
            num_warps=warps, num_stages=stages)


def chain(kern, x: torch.Tensor, o: torch.Tensor, wo: torch.Tensor, wgu: torch.Tensor, bgu: torch.Tensor | None,
          wd: torch.Tensor, eps: float) -> None:
    """The engine's `_decode_folded` after the attention (forward.py), on x in place."""
    x.addmm_(o, wo.t())
    gate, up = torch.mm(x, wgu.t()).chunk(2, dim=-1)
    x.addmm_(kern.silu_mul(gate, up, norm_of=x, eps=eps, bias=bgu), wd.t())


def reference(x: torch.Tensor, o: torch.Tensor, wo: torch.Tensor, wgu: torch.Tensor, bgu: torch.Tensor | None,
              wd: torch.Tensor, eps: float) -> torch.Tensor:
    """The same math in fp32 (what both are compared with)."""
    x = x.float() + o.float() @ wo.float().t()
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    gu = (x @ wgu.float().t()) * rstd + (bgu.float() if bgu is not None else 0)
    g, u = gu.chunk(2, dim=-1)
    return x + (torch.nn.functional.silu(g) * u) @ wd.float().t()


def graph_us(fns: list, replays: int = 20) -> float:
    for f in fns:
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * len(fns))


def bench(shape: str, rows: int, configs: list[dict]) -> list[dict]:
    from fleetrl.engines.fast.triton_kernels import TritonKernels

    hidden, q, inter, layers = SHAPES[shape]
    dev, dt, eps = torch.device("cuda"), torch.bfloat16, 1e-6
    torch.manual_seed(0)
    wo = [torch.randn(hidden, q, device=dev, dtype=dt) / q ** 0.5 for _ in range(layers)]
    wgu = [torch.randn(2 * inter, hidden, device=dev, dtype=dt) / hidden ** 0.5 for _ in range(layers)]
    wd = [torch.randn(hidden, inter, device=dev, dtype=dt) / inter ** 0.5 for _ in range(layers)]
    bgu = [torch.randn(2 * inter, device=dev, dtype=dt) * 0.1 for _ in range(layers)]
    o = torch.randn(rows, q, device=dev, dtype=dt)
    x0 = torch.randn(rows, hidden, device=dev, dtype=dt)
    kern = TritonKernels(dev)
    sms = kern.num_sms
    ref = reference(x0, o, wo[0], wgu[0], bgu[0], wd[0], eps)
    out = []

    def err(x: torch.Tensor) -> float:
        return float(f"{((x.float() - ref).abs().max() / ref.abs().max()).item():.2e}")

    x = x0.clone()
    chain(kern, x, o, wo[0], wgu[0], bgu[0], wd[0], eps)
    xs = [x0.clone() for _ in range(layers)]  # each layer its own x: replays keep it finite (x grows by a layer)
    t = graph_us([lambda i=i: chain(kern, xs[i], o, wo[i], wgu[i], bgu[i], wd[i], eps) for i in range(layers)])
    out.append(dict(shape=shape, rows=rows, impl="cublas chain", us=round(t, 2), rel_err=err(x)))
    print(out[-1], flush=True)
    for cfg in configs:
        runs = [PersistentMLP(rows, hidden, inter, dev, dt, cfg.get("programs", sms), cfg.get("splits", 8),
                              cfg.get("bk", 64)) for _ in range(layers)]
        kw = dict(bn=cfg.get("bn", (16, 32, 64, 64)), warps=cfg.get("warps", 4), stages=cfg.get("stages", 3),
                  phases=cfg.get("phases", (3, 6)))
        try:
            x = x0.clone()
            runs[0](x, o, wo[0], wgu[0], bgu[0], wd[0], eps, **kw)
            torch.cuda.synchronize()
            e = err(x) if kw["phases"] == (3, 6) else None
            x2 = x0.clone()  # the same phases as separate launches (no barrier): a race would show as a difference
            for ph in range(kw["phases"][0], kw["phases"][1] + 1):
                runs[0](x2, o, wo[0], wgu[0], bgu[0], wd[0], eps, **{**kw, "phases": (ph, ph)})
            e_split = err(x2) if kw["phases"] == (3, 6) else None
            xs = [x0.clone() for _ in range(layers)]
            t = graph_us([lambda i=i: runs[i](xs[i], o, wo[i], wgu[i], bgu[i], wd[i], eps, **kw)
                          for i in range(layers)])
            out.append(dict(shape=shape, rows=rows, impl=f"persistent {cfg}", us=round(t, 2), rel_err=e,
                            rel_err_phase_launches=e_split))
        except Exception as ex:  # a config that does not compile or fit: record why, go on
            out.append(dict(shape=shape, rows=rows, impl=f"persistent {cfg}", error=str(ex)[:300]))
        print(out[-1], flush=True)
    return out


BEST = {"stages": 4, "bk": 128, "bn": (16, 64, 64, 64)}
CONFIGS = [
    BEST,
    {**BEST, "stages": 6},
    {**BEST, "bk": 64, "stages": 6},
    {**BEST, "bn": (32, 64, 64, 64)},
    {**BEST, "bn": (16, 64, 32, 64), "splits": 4},
    {**BEST, "warps": 8},
] + [{**BEST, "phases": (p, p)} for p in (3, 4, 5, 6)]


def main() -> None:
    from bench.common import device_info, out_dir, write_json

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", default="qwen2.5-0.5b,qwen2.5-1.5b")
    ap.add_argument("--rows", default="16,64")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for shape in args.shapes.split(","):
        for m in (int(r) for r in args.rows.split(",")):
            rows += bench(shape, m, CONFIGS)
            write_json(out_dir(args.out) / "persistent_mlp.json", {"device": device_info("cuda"), "rows": rows})


if __name__ == "__main__":
    main()
