"""Fused Triton kernels for the CUDA decode step (import only where `triton` is installed).

Why: a decode step is ~40 tiny torch ops per layer; inside a CUDA graph each still costs a few microseconds,
which for a 0.5B model at batch 256 is more than the weight and KV reads themselves. These fusions cut a
layer to 8 launches with the fused q/k/v and gate/up copies, 6 with the norms folded into them (plus a split
merge at small batch), and the attention kernel reads each slot's KV only up to its own length.

  add_rmsnorm       x += delta (model dtype, as HF's residual add), y = RMSNorm(x) * w
  decode_attention  (Qwen3: each head of the new q and k RMS-normalised by its q_norm / k_norm weight, then)
                    RoPE on the new q and k and k/v written into the cache at each slot's position (by the one
                    program whose span holds it, before its reads), then split-K "flash-decoding" (Dao et al., 2023,
                    https://crfm.stanford.edu/2023/10/12/flashdecoding.html): grid (slot x kv_head, split); the
                    G query heads of one KV head are the rows of one tile, so K/V are read once per KV head (GQA);
                    the samples of one prompt read its cached rows at their leader slot (one HBM read per group,
                    the rest from L2; adjacent slots run together); a second kernel merges the splits' softmax
                    states (skipped when the batch alone fills the GPU and one split covers the cache)
  silu_mul          silu(gate) * up
  (folded norms)    attention and silu_mul can also take the row's 1/rms from the residual stream and add the
                    projection's bias themselves, when the norm weight is folded into the GEMM before them
                    (fused.py fold_norms, forward.py `_decode_folded`): then a layer has no norm kernel
  sample            pass 1 reads the logits once (per block: max, sum of exp); pass 2 per row: log-sum-exp, then
                    the token in two exact stages (sampling.py): a block by inverse CDF over the block masses
                    (fp64), then a token within that block by the exponential race (Gumbel-max)
  step_update       append the sampled token, advance positions, update done flags (one launch)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fleetrl.engines.fast.arch import DecoderSpec

ATTN_SPLIT = 256      # cache positions per split program
ATTN_BLOCK_N = 64     # positions per inner tile
# (num_warps, num_stages) of the attention launch by head dim, from bench/decode_attn.py on an H200 (batch 256):
# at 128, 2 warps and 2 stages ran 16-17% faster than 4 and 3; at 64 none beat 4 and 3 (Triton's default) by more
# than the noise
ATTN_LAUNCH = {128: (2, 2)}
ATTN_LAUNCH_DEFAULT = (4, 3)
SAMPLE_BLOCK_V = 4096  # logits per pass-1 program, and the block pass 2 draws its token from
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _add_rmsnorm_kernel(x_ptr, d_ptr, w_ptr, y_ptr, n_cols, eps, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(d_ptr + row * n_cols + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    y = (xf * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(y_ptr + row * n_cols + cols, (w.to(tl.float32) * y.to(tl.float32)).to(y_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _inv_rms(x_ptr, row, n_cols, eps, HB: tl.constexpr):
    """1 / sqrt(mean(x[row]²) + eps) in fp32, as HF's RMSNorm takes it from the model-dtype residual."""
    cols = tl.arange(0, HB)
    x = tl.load(x_ptr + row * n_cols + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    return tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)


@triton.jit
def _proj_load(ptr, offs, mask, rstd, b_ptr, b_offs, FOLD: tl.constexpr, HAS_BIAS: tl.constexpr):
    """A projection's output as the layer reads it, in fp32: with FOLD the GEMM ran on the un-normalised x with
    the norm weight folded in, so scale by the row's 1/rms, add the bias and round to the model dtype, where HF
    rounds its biased GEMM output."""
    v = tl.load(ptr + offs, mask=mask, other=0.0)
    if FOLD:
        f = v.to(tl.float32) * rstd
        if HAS_BIAS:
            f += tl.load(b_ptr + b_offs, mask=mask, other=0.0).to(tl.float32)
        v = f.to(ptr.dtype.element_ty)
    return v.to(tl.float32)


@triton.jit
def _head_norm(x, inv, w, like_ptr):
    """HF's RMSNorm output for one head's values x (fp32, already the projection's model-dtype values) given the
    head's 1/rms `inv`: x·inv rounded to the model dtype (`like_ptr`'s element type), times the norm weight w,
    rounded again (HF's `weight * h.to(input_dtype)`), returned in fp32 for RoPE."""
    dt = like_ptr.dtype.element_ty
    return (w.to(tl.float32) * (x * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)


@triton.jit
def _decode_attn_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, pos_ptr, lead_ptr, shared_ptr, o_ptr,
                        m_ptr, l_ptr, out_ptr, x_ptr, b_ptr, qn_ptr, kn_ptr, n_hidden, eps, scale, s_slot, s_head,
                        s_pos, s_q, s_kv,
                        H: tl.constexpr, KVH: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                        SPLIT: tl.constexpr, NSPLIT: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                        FOLD: tl.constexpr, HAS_BIAS: tl.constexpr, HB: tl.constexpr, QK_NORM: tl.constexpr):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = (pid // KVH).to(tl.int64)
    kh = pid % KVH
    pos = tl.load(pos_ptr + b)
    rstd = 1.0
    if FOLD:
        rstd = _inv_rms(x_ptr, b, n_hidden, eps, HB)
    length = (pos + 1).to(tl.int32)
    start = split * SPLIT
    end = tl.minimum(start + SPLIT, length)
    g = tl.arange(0, G_PAD)
    gmask = g < G
    d = tl.arange(0, D)
    heads = kh * G + g
    # RoPE as HF: x * cos + rotate_half(x) * sin, in fp32, rounded to the model dtype (cos/sin rows hold the
    # half-width frequencies twice, so column d and d + D/2 share one angle)
    c = tl.load(cos_ptr + pos * D + d).to(tl.float32)
    sn = tl.load(sin_ptr + pos * D + d).to(tl.float32)
    sign = tl.where(d < D // 2, -1.0, 1.0)
    swap = (d + D // 2) % D
    qp = q_ptr + b * s_q
    qo = heads[:, None] * D
    q_d = _proj_load(qp, qo + d[None, :], gmask[:, None], rstd, b_ptr, qo + d[None, :], FOLD, HAS_BIAS)
    q_sw = _proj_load(qp, qo + swap[None, :], gmask[:, None], rstd, b_ptr, qo + swap[None, :], FOLD, HAS_BIAS)
    if QK_NORM:  # Qwen3: per-head RMSNorm of the projected q, after the folded norm's 1/rms and the bias, before RoPE
        q_inv = tl.rsqrt(tl.sum(q_d * q_d, axis=1) / D + eps)[:, None]  # q_sw holds the same values, permuted
        q_d = _head_norm(q_d, q_inv, tl.load(qn_ptr + d)[None, :], q_ptr)
        q_sw = _head_norm(q_sw, q_inv, tl.load(qn_ptr + swap)[None, :], q_ptr)
    q = (q_d * c[None, :] + sign[None, :] * sn[None, :] * q_sw).to(q_ptr.dtype.element_ty)
    base = b * s_slot + kh * s_head
    # Positions below `shared` are read from the leader slot's rows (equal to this slot's: the prefill copied
    # them): the n samples of a prompt read its cache rows once from HBM, the others hit in L2.
    shared = tl.load(shared_ptr + b)
    lbase = tl.load(lead_ptr + b) * s_slot + kh * s_head
    if (start <= pos) & (pos < start + SPLIT):  # the one program of this head whose span holds the new token
        kp, vp, kb = k_ptr + b * s_kv + kh * D, v_ptr + b * s_kv + kh * D, H * D + kh * D  # kb: k's bias column
        every = d < D
        k_d = _proj_load(kp, d, every, rstd, b_ptr, kb + d, FOLD, HAS_BIAS)
        k_sw = _proj_load(kp, swap, every, rstd, b_ptr, kb + swap, FOLD, HAS_BIAS)
        if QK_NORM:
            k_inv = tl.rsqrt(tl.sum(k_d * k_d, axis=0) / D + eps)
            k_d = _head_norm(k_d, k_inv, tl.load(kn_ptr + d), k_ptr)
            k_sw = _head_norm(k_sw, k_inv, tl.load(kn_ptr + swap), k_ptr)
        k_new = k_d * c + sign * k_sw * sn
        tl.store(kc_ptr + base + pos * s_pos + d, k_new.to(kc_ptr.dtype.element_ty))
        v_new = _proj_load(vp, d, every, rstd, b_ptr, kb + KVH * D + d, FOLD, HAS_BIAS)
        tl.store(vc_ptr + base + pos * s_pos + d, v_new.to(vc_ptr.dtype.element_ty))
    tl.debug_barrier()  # the block's cache writes are visible to all its threads before the loop reads them
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nmask = n < end
        off = tl.where(n < shared, lbase, base)[:, None] + n[:, None] * s_pos + d[None, :]
        k = tl.load(kc_ptr + off, mask=nmask[:, None], other=0.0)
        v = tl.load(vc_ptr + off, mask=nmask[:, None], other=0.0)
        if IEEE:
            sc = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            sc = tl.dot(q, tl.trans(k))
        sc = tl.where(nmask[None, :], sc * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    if NSPLIT == 1:  # one program saw the whole sequence: finish here, no merge kernel
        out = acc / l_i[:, None]
        tl.store(out_ptr + b * H * D + heads[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=gmask[:, None])
    else:
        row = (b * H + heads) * NSPLIT + split
        tl.store(o_ptr + row[:, None] * D + d[None, :], acc, mask=gmask[:, None])
        tl.store(m_ptr + row, m_i, mask=gmask)
        tl.store(l_ptr + row, l_i, mask=gmask)


@triton.jit
def _decode_merge_kernel(o_ptr, m_ptr, l_ptr, out_ptr, D: tl.constexpr, NSPLIT: tl.constexpr,
                         S_PAD: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    sp = tl.arange(0, S_PAD)
    smask = sp < NSPLIT
    m = tl.load(m_ptr + bh * NSPLIT + sp, mask=smask, other=float("-inf"))
    l = tl.load(l_ptr + bh * NSPLIT + sp, mask=smask, other=0.0)
    w = tl.exp(m - tl.max(m, 0))  # empty splits have m = -inf -> weight 0 (split 0 is never empty)
    d = tl.arange(0, D)
    o = tl.load(o_ptr + (bh * NSPLIT + sp)[:, None] * D + d[None, :], mask=smask[:, None], other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(out_ptr + bh * D + d, out.to(out_ptr.dtype.element_ty))


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, y_ptr, x_ptr, b_ptr, n_cols, s_in, n_hidden, eps, BLOCK: tl.constexpr,
                     FOLD: tl.constexpr, HAS_BIAS: tl.constexpr, HB: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    rstd = 1.0
    if FOLD:
        rstd = _inv_rms(x_ptr, row, n_hidden, eps, HB)
    g = _proj_load(g_ptr + row * s_in, cols, mask, rstd, b_ptr, cols, FOLD, HAS_BIAS)
    u = _proj_load(u_ptr + row * s_in, cols, mask, rstd, b_ptr, n_cols + cols, FOLD, HAS_BIAS)
    act = (g * tl.sigmoid(g)).to(y_ptr.dtype.element_ty).to(tl.float32)  # HF rounds silu() to the dtype first
    tl.store(y_ptr + row * n_cols + cols, (act * u).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sample_stats_kernel(x_ptr, stride, V, temp_ptr, bmax_ptr, bsum_ptr, bidx_ptr, NBLK,
                         GREEDY: tl.constexpr, BLOCK_V: tl.constexpr):
    """Pass 1, grid (row, block): the block's max logit, sum of exp((x - max) / T), and (greedy) its argmax."""
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    cols = blk * BLOCK_V + tl.arange(0, BLOCK_V)
    x = tl.load(x_ptr + row * stride + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    m = tl.max(x, 0)
    c = LOG2E / tl.load(temp_ptr)
    e = tl.exp2((x - tl.where(m == float("-inf"), 0.0, m)) * c)  # an all-padding block has m = -inf, e = 0
    out = row * NBLK + blk
    tl.store(bmax_ptr + out, m)
    tl.store(bsum_ptr + out, tl.sum(e, 0))
    if GREEDY:
        tl.store(bidx_ptr + out, blk * BLOCK_V + tl.argmax(x, 0))  # ties -> lowest id, as torch.argmax


@triton.jit
def _race_sub_block(x_ptr, row, stride, V, m, c, cols, r):
    """(best p_i / E_i, its index in `cols`) with E_i = -log U_i ~ Exp(1), p_i = exp((x_i - m) / T)."""
    x = tl.load(x_ptr + row * stride + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    ratio = tl.exp2((x - m) * c) / -tl.log(tl.random.uint_to_uniform_float(r))
    return tl.max(ratio, 0), tl.argmax(ratio, 0)


@triton.jit
def _sample_select_kernel(x_ptr, stride, V, temp_ptr, seed_ptr, req_ptr, cnt_ptr, bmax_ptr, bsum_ptr, bidx_ptr,
                          tok_ptr, lp_ptr, NBLK, GREEDY: tl.constexpr, NB_PAD: tl.constexpr, BLOCK_V: tl.constexpr):
    """Pass 2, one program per row: log-sum-exp from the block stats, then the token (module docstring)."""
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, NB_PAD)
    mask = i < NBLK
    bmax = tl.load(bmax_ptr + row * NBLK + i, mask=mask, other=float("-inf"))
    bsum = tl.load(bsum_ptr + row * NBLK + i, mask=mask, other=0.0)
    temp = tl.load(temp_ptr)
    c = LOG2E / temp
    m = tl.max(bmax, 0)
    w = tl.where(mask, bsum * tl.exp2((bmax - m) * c), 0.0)  # block masses, on the row max's scale
    lse = m / temp + tl.log(tl.sum(w, 0))
    if GREEDY:
        tok = tl.load(bidx_ptr + row * NBLK + tl.argmax(bmax, 0))
    else:
        # one Philox4x32 call per 4 x Q uniforms; key = (call seed, request, token index), never the slot
        seed = tl.load(seed_ptr) * 1099511627776 + tl.load(req_ptr + row) * 1048576 + tl.load(cnt_ptr + row)
        one = tl.arange(0, 1)
        a, b, _, _ = tl.randint4x(seed, one)
        # stage 1: the block, by inverse CDF over the block masses with a 53-bit uniform in fp64
        u = (tl.sum((a >> 5).to(tl.float64), 0) * 67108864.0 + tl.sum((b >> 6).to(tl.float64), 0)) * (2.0 ** -53)
        cw = tl.cumsum(w.to(tl.float64), 0)
        target = u * tl.max(cw, 0)
        blk = tl.minimum(tl.sum(((cw <= target) & mask).to(tl.int32), 0), NBLK - 1)
        # stage 2: the token within it, by the exponential race over that block's 4 x Q logits
        Q: tl.constexpr = BLOCK_V // 4
        lanes = tl.arange(0, Q)
        base = blk * BLOCK_V
        r0, r1, r2, r3 = tl.randint4x(seed, lanes + 1)
        k0, i0 = _race_sub_block(x_ptr, row, stride, V, m, c, base + lanes, r0)
        k1, i1 = _race_sub_block(x_ptr, row, stride, V, m, c, base + Q + lanes, r1)
        k2, i2 = _race_sub_block(x_ptr, row, stride, V, m, c, base + 2 * Q + lanes, r2)
        k3, i3 = _race_sub_block(x_ptr, row, stride, V, m, c, base + 3 * Q + lanes, r3)
        kmax, kidx = k0, i0
        kidx = tl.where(k1 > kmax, Q + i1, kidx)  # strict '>': ties keep the lower token id
        kmax = tl.maximum(kmax, k1)
        kidx = tl.where(k2 > kmax, 2 * Q + i2, kidx)
        kmax = tl.maximum(kmax, k2)
        kidx = tl.where(k3 > kmax, 3 * Q + i3, kidx)
        tok = (base + kidx).to(tl.int64)
    z_tok = tl.load(x_ptr + row * stride + tok).to(tl.float32) / temp
    tl.store(tok_ptr + row, tok)
    tl.store(lp_ptr + row, z_tok - lse)


@triton.jit
def _step_update_kernel(tok_ptr, lp_ptr, done_ptr, count_ptr, limit_ptr, pos_ptr, tokens_ptr, out_tok_ptr,
                        out_lp_ptr, stop_ptr, n, out_stride, N_STOP: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = r < n
    tok = tl.load(tok_ptr + r, mask=m, other=0)
    done = tl.load(done_ptr + r, mask=m, other=1).to(tl.int32)
    cnt = tl.load(count_ptr + r, mask=m, other=0)
    live = m & (done == 0)
    dst = r.to(tl.int64) * out_stride + cnt
    tl.store(out_tok_ptr + dst, tok, mask=live)
    tl.store(out_lp_ptr + dst, tl.load(lp_ptr + r, mask=m, other=0.0), mask=live)
    cnt = cnt + live.to(tl.int64)
    tl.store(count_ptr + r, cnt, mask=m)
    tl.store(pos_ptr + r, tl.load(pos_ptr + r, mask=m, other=0) + live.to(tl.int64), mask=m)
    tl.store(tokens_ptr + r, tok, mask=m)
    stops = tl.load(stop_ptr + tl.arange(0, N_STOP))
    hit = tl.max((tok[:, None] == stops[None, :]).to(tl.int32), 1)
    limit = tl.load(limit_ptr + r, mask=m, other=1)
    new_done = (done != 0) | (hit != 0) | (cnt >= limit)
    tl.store(done_ptr + r, new_done, mask=m)


def _pow2(n: int) -> int:
    return triton.next_power_of_2(n)


class TritonKernels:
    """Thin launchers; every output is allocated here (inside a CUDA graph it comes from the graph's pool)."""

    def __init__(self, device: torch.device) -> None:
        on_gpu = device.type == "cuda"
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count if on_gpu else 4

    @staticmethod
    def supports(spec: DecoderSpec, dtype: torch.dtype) -> bool:
        return (dtype in (torch.bfloat16, torch.float16, torch.float32) and spec.head_dim >= 16
                and spec.head_dim & (spec.head_dim - 1) == 0 and spec.group <= 64)

    def add_rmsnorm(self, x: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor, eps: float,
                    out: torch.Tensor) -> None:
        n, hidden = x.shape
        _add_rmsnorm_kernel[(n,)](x, x if delta is None else delta, w, out, hidden, eps,
                                  HAS_DELTA=delta is not None, BLOCK=_pow2(hidden), num_warps=4)

    def attention_splits(self, nb: int, kv_heads: int, max_len: int) -> tuple[int, int]:
        """(splits, positions per split): split the cache span only as much as needed to give every SM about
        two programs; at large batch that is one split, and the merge kernel is skipped."""
        nsplit = max(1, min(triton.cdiv(max_len, ATTN_SPLIT), triton.cdiv(2 * self.num_sms, nb * kv_heads)))
        split = triton.cdiv(triton.cdiv(max_len, nsplit), ATTN_BLOCK_N) * ATTN_BLOCK_N
        return triton.cdiv(max_len, split), split

    def decode_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, pos: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, spec: DecoderSpec,
                         scale: float, lead: torch.Tensor, shared: torch.Tensor, norm_of: torch.Tensor | None = None,
                         bias: torch.Tensor | None = None, q_norm: torch.Tensor | None = None,
                         k_norm: torch.Tensor | None = None) -> torch.Tensor:
        """q [nb, H·d], k, v [nb, KVH·d] of the new tokens (before RoPE; possibly column views of one fused GEMM
        output: rows strided, each row's heads contiguous) -> attention output [nb, H·d]. RoPE is applied to q
        and k, and k/v are written into the caches at each slot's position, inside the attention kernel.
        lead, shared [nb] long: slot b reads its positions below shared[b] from slot lead[b]'s cache rows, which
        must hold the same values (a shared prompt's prefix; shared = 0 reads its own rows only).
        norm_of [nb, hidden]: q/k/v came from the un-normalised residual x with the norm weight folded into the
        GEMM (fused.py); scale each row by its 1/rms(x) (eps = spec.rms_eps), then add `bias` [H·d + 2·KVH·d].
        q_norm, k_norm [d]: Qwen3's per-head RMSNorm weights (eps = spec.rms_eps), applied to each head of the new
        q and k (after the folded norm and bias above, before RoPE); both or neither."""
        assert q.stride(1) == k.stride(1) == v.stride(1) == 1 and k.stride(0) == v.stride(0)
        assert cos.shape[1] == spec.head_dim and cos.is_contiguous() and sin.is_contiguous()
        nb, max_len = q.shape[0], kc.shape[2]
        nsplit, split = self.attention_splits(nb, spec.num_kv_heads, max_len)
        parts = torch.empty(nb, spec.num_heads, nsplit, spec.head_dim, dtype=torch.float32, device=q.device)
        m = torch.empty(nb, spec.num_heads, nsplit, dtype=torch.float32, device=q.device)
        lsum = torch.empty_like(m)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous even when q is a strided view
        fold = norm_of is not None
        assert not fold or (norm_of.is_contiguous() and norm_of.shape == (nb, spec.hidden))
        qk_norm = q_norm is not None
        assert qk_norm == (k_norm is not None) == spec.qk_norm, "q_norm and k_norm come together (Qwen3)"
        assert not qk_norm or all(t.is_contiguous() and t.shape == (spec.head_dim,) for t in (q_norm, k_norm))
        warps, stages = ATTN_LAUNCH.get(spec.head_dim, ATTN_LAUNCH_DEFAULT)
        _decode_attn_kernel[(nb * spec.num_kv_heads, nsplit)](
            q, k, v, cos, sin, kc, vc, pos, lead, shared, parts, m, lsum, out, norm_of if fold else q,
            bias if bias is not None else q, q_norm if qk_norm else q, k_norm if qk_norm else q,
            spec.hidden, spec.rms_eps, scale, kc.stride(0), kc.stride(1),
            kc.stride(2), q.stride(0), k.stride(0),
            H=spec.num_heads, KVH=spec.num_kv_heads, G=spec.group, G_PAD=max(16, _pow2(spec.group)),
            D=spec.head_dim, SPLIT=split, NSPLIT=nsplit, BLOCK_N=ATTN_BLOCK_N,
            IEEE=q.dtype == torch.float32, FOLD=fold, HAS_BIAS=fold and bias is not None,
            HB=_pow2(spec.hidden), QK_NORM=qk_norm, num_warps=warps, num_stages=stages)
        if nsplit > 1:
            _decode_merge_kernel[(nb * spec.num_heads,)](parts, m, lsum, out, D=spec.head_dim, NSPLIT=nsplit,
                                                        S_PAD=max(2, _pow2(nsplit)), num_warps=2)
        return out

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor, norm_of: torch.Tensor | None = None, eps: float = 0.0,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        """gate, up [n, I] (column views of one fused [n, 2I] output, or two contiguous tensors) -> [n, I].
        norm_of [n, hidden]: folded norm (as in `decode_attention`): scale gate and up by each row's 1/rms, then
        add `bias` [2I] (gate's, then up's)."""
        assert gate.stride() == up.stride() and gate.stride(1) == 1
        n, cols = gate.shape
        out = torch.empty(n, cols, dtype=gate.dtype, device=gate.device)
        fold = norm_of is not None
        assert not fold or (norm_of.is_contiguous() and norm_of.shape[0] == n)
        hidden = norm_of.shape[1] if fold else 1
        _silu_mul_kernel[(n, triton.cdiv(cols, 1024))](
            gate, up, out, norm_of if fold else gate, bias if bias is not None else gate, cols, gate.stride(0),
            hidden, eps, BLOCK=1024, FOLD=fold, HAS_BIAS=fold and bias is not None, HB=_pow2(hidden), num_warps=4)
        return out

    def step_update(self, tok: torch.Tensor, lp: torch.Tensor, done: torch.Tensor, count: torch.Tensor,
                    limit: torch.Tensor, pos: torch.Tensor, tokens: torch.Tensor, out_tok: torch.Tensor,
                    out_lp: torch.Tensor, stop_ids: torch.Tensor) -> None:
        """The decode step's bookkeeping (engine._step_torch) in one launch instead of ~16."""
        n = tok.shape[0]
        _step_update_kernel[(triton.cdiv(n, 256),)](tok, lp, done, count, limit, pos, tokens, out_tok, out_lp,
                                                   stop_ids, n, out_tok.stride(0), N_STOP=stop_ids.shape[0],
                                                   BLOCK=256, num_warps=4)

    def sample(self, logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor, req: torch.Tensor,
               count: torch.Tensor, *, greedy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [n, V] in the model dtype -> (token [n] long, logprob [n] fp32); two launches, no [n, V] copy."""
        n, vocab = logits.shape
        nblk = triton.cdiv(vocab, SAMPLE_BLOCK_V)
        bmax = torch.empty(n, nblk, dtype=torch.float32, device=logits.device)
        bsum = torch.empty_like(bmax)
        bidx = torch.empty(n, nblk, dtype=torch.long, device=logits.device)
        _sample_stats_kernel[(n, nblk)](logits, logits.stride(0), vocab, temperature, bmax, bsum, bidx, nblk,
                                        GREEDY=greedy, BLOCK_V=SAMPLE_BLOCK_V, num_warps=8)
        tok = torch.empty(n, dtype=torch.long, device=logits.device)
        lp = torch.empty(n, dtype=torch.float32, device=logits.device)
        _sample_select_kernel[(n,)](logits, logits.stride(0), vocab, temperature, seed, req, count, bmax, bsum, bidx,
                                    tok, lp, nblk, GREEDY=greedy, NB_PAD=max(2, _pow2(nblk)),
                                    BLOCK_V=SAMPLE_BLOCK_V, num_warps=8)
        return tok, lp
