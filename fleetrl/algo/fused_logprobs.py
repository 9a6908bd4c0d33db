"""Log-probs of the sampled tokens and the entropy, fused with the output projection (hidden -> vocab).

The plain path materialises logits [N, V] in fp32 (and autograd keeps them, plus the softmax, for backward):
for the Qwen2.5 vocabulary (V = 151,936) that is 0.6 MB per token, 10 GB for a 16k-token micro-batch. Here
the projection, log-softmax, gather and entropy run over `chunk` tokens at a time; backward recomputes each
chunk's logits from the saved hidden states and weight, so at most chunk x V fp32 values are alive at once.

Formulas (z = W h / T, p = softmax(z), lse = logsumexp(z)):
    logp_t  = z_t - lse                      (t = the sampled token)
    H       = lse - sum_j p_j z_j            (entropy)
    dlogp_t / dz_j = 1[j = t] - p_j
    dH / dz_j      = -p_j (log p_j + H)      (differentiate -sum_j p_j log p_j; sum_j dp_j = 0)
so dL/dz = g_logp (onehot_t - p) - g_H p (log p + H), and dL/dh = (dL/dz / T) W, dL/dW = (dL/dz / T)^T h.

Precision: the matmul runs in `compute_dtype` (the autocast dtype inside torch.autocast, else the hidden
states' dtype), softmax statistics in fp32, as `head(h).float()` does under autocast.
"""
from __future__ import annotations

import functools
import weakref
from typing import Any, Callable

import torch
from torch import Tensor

# id(weight) -> (a weak reference to it, its _version when cast, the cast copy): frozen heads only (`cast_head`).
# Keyed by id, not by the tensor: a WeakKeyDictionary compares colliding keys with ==, elementwise for tensors.
_FROZEN_CASTS: dict[int, tuple[weakref.ref, int, Tensor]] = {}


def fused_logprobs_entropy(hidden_NH: Tensor, weight_VH: Tensor, targets_N: Tensor, *, temperature: float = 1.0,
                           chunk: int = 4096, return_entropy: bool = True) -> tuple[Tensor, Tensor | None]:
    """logp_N (log softmax(W h / T) at targets) and entropy_N, fp32; differentiable in hidden and weight.

    hidden_NH: [N, H]; weight_VH: [V, H] (an LM head without bias); targets_N: [N] token ids.
    `chunk` tokens are projected at a time (chunk x V fp32 logits at most, in forward and in backward).
    """
    if chunk <= 0:
        raise ValueError(f"fused_logprobs_entropy: chunk must be a positive number of tokens, got {chunk}")
    if temperature <= 0:
        raise ValueError(f"fused_logprobs_entropy: temperature must be > 0, got {temperature}")
    device = hidden_NH.device.type
    compute = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden_NH.dtype
    with torch.autocast(device_type=device, enabled=False):  # dtypes are chosen explicitly below
        logp, ent = _FusedLogprobs.apply(hidden_NH, weight_VH, targets_N, float(temperature), int(chunk),
                                         compute, bool(return_entropy))
    return logp, (ent if return_entropy else None)


def cast_head(weight_VH: Tensor, compute: torch.dtype) -> Tensor:
    """The head weight in `compute`. A frozen weight (LoRA's tied embedding) keeps its cast copy between calls:
    casting SmolLM2's 49k x 576 fp32 head took ~39 ms on 2 CPU cores, twice per micro-batch (forward and
    backward). The copy is made again after any in-place change (weight sync), which bumps the tensor's _version."""
    if weight_VH.dtype == compute:
        return weight_VH
    if weight_VH.requires_grad:
        return weight_VH.to(compute)
    key = id(weight_VH)
    cached = _FROZEN_CASTS.get(key)
    if (cached is None or cached[0]() is not weight_VH or cached[1] != weight_VH._version
            or cached[2].dtype != compute):
        if cached is None or cached[0]() is not weight_VH:
            weakref.finalize(weight_VH, _FROZEN_CASTS.pop, key, None)  # the copy goes with the weight
        cached = (weakref.ref(weight_VH), weight_VH._version, weight_VH.detach().to(compute))
        _FROZEN_CASTS[key] = cached
    return cached[2]


# CPU: each chunk's softmax statistics and logit gradient (`_stats`, `_grad`) run as one Inductor kernel each.
# Why: eagerly their torch ops pass over the [c, V] fp32 logits ~15 times per chunk, each at a few GB/s on a 2-core
# VM: ~2 s of SmolLM2's 9.5 s LoRA update (bench/RESULTS.md, "Eleventh session"). GPUs run them eagerly: their
# chunks are large (4096 x 152k fp32 = 2.5 GB), and the in-place ops bound them to two such buffers.
FUSE_ON_CPU = True  # tests/conftest.py sets it False; tests/models/test_packing.py checks compiled == eager


@functools.cache
def _compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    return torch.compile(fn, dynamic=True)  # dynamic: one graph for every chunk length (the last is shorter)


def _chunk_fn(fn: Callable[..., Any], device: torch.device) -> Callable[..., Any]:
    return _compiled(fn) if device.type == "cpu" and FUSE_ON_CPU else fn


class _FusedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_NH: Tensor, weight_VH: Tensor, targets_N: Tensor, temperature: float, chunk: int,
                compute: torch.dtype, with_entropy: bool) -> tuple[Tensor, Tensor]:
        n = hidden_NH.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden_NH.device)
        ent = torch.zeros(n, dtype=torch.float32, device=hidden_NH.device)
        w = cast_head(weight_VH, compute)  # one cast for all chunks (as autocast caches it)
        tgt = targets_N.long()
        stats = _chunk_fn(_stats, hidden_NH.device)
        for s, e in _chunks(n, chunk):
            z = hidden_NH[s:e].to(compute) @ w.t()
            logp[s:e], ent[s:e] = stats(z, tgt[s:e], temperature, with_entropy)
        ctx.save_for_backward(hidden_NH, weight_VH, tgt, ent)
        ctx.cfg = (temperature, chunk, compute, with_entropy)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp: Tensor, g_ent: Tensor) -> tuple[Tensor | None, ...]:
        hidden_NH, weight_VH, tgt, ent = ctx.saved_tensors
        temperature, chunk, compute, with_entropy = ctx.cfg
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        w = cast_head(weight_VH, compute)
        grad_h = torch.empty_like(hidden_NH) if need_h else None
        grad_w = torch.zeros(weight_VH.shape, dtype=torch.float32, device=weight_VH.device) if need_w else None
        g_logp = g_logp.float() if g_logp is not None else torch.zeros_like(ent)
        with_entropy = with_entropy and g_ent is not None
        g_ent = g_ent.float() if with_entropy else torch.zeros_like(ent)
        grad = _chunk_fn(_grad, hidden_NH.device)
        for s, e in _chunks(hidden_NH.shape[0], chunk):
            h = hidden_NH[s:e]
            g_z = grad(h.to(compute) @ w.t(), tgt[s:e], g_logp[s:e], g_ent[s:e], ent[s:e], temperature, with_entropy)
            if need_h:
                grad_h[s:e] = (g_z @ w).to(hidden_NH.dtype)
            if need_w:
                grad_w += (g_z.t() @ h.to(compute)).float()
        return grad_h, (grad_w.to(weight_VH.dtype) if need_w else None), None, None, None, None, None


def _chunks(n: int, chunk: int) -> list[tuple[int, int]]:
    """[start, end) of each chunk of n rows; a 1-row remainder is joined by a row of the chunk before it. Why:
    dynamo specialises a size of 1, so a 1-row chunk would recompile the CPU kernels (~10 s) mid-run."""
    bounds = [(s, min(s + chunk, n)) for s in range(0, n, chunk)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] == 1 and chunk > 2:
        (s0, e0), (_, e1) = bounds[-2], bounds[-1]
        bounds[-2:] = [(s0, e0 - 1), (e0 - 1, e1)]
    return bounds


def _stats(z_cV: Tensor, tgt_c: Tensor, temperature: float, with_entropy: bool) -> tuple[Tensor, Tensor]:
    """(log p at the targets, entropy) [c] fp32 from one chunk's unscaled logits z [c, V] in the compute dtype; at
    most two [c, V] fp32 buffers alive."""
    z = z_cV.float() / temperature
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, tgt_c[:, None]).squeeze(-1) - lse
    if not with_entropy:
        return logp, torch.zeros_like(lse)
    p = (z - lse[:, None]).exp_()  # H = lse - sum_j p_j z_j, the sum as a batched dot product (no [c, V] product)
    return logp, lse - torch.bmm(p[:, None, :], z[:, :, None]).view(-1)


def _grad(z_cV: Tensor, tgt_c: Tensor, g_logp_c: Tensor, g_ent_c: Tensor, ent_c: Tensor, temperature: float,
          with_entropy: bool) -> Tensor:
    """dL/d(W h) [c, V] in z's dtype: (g_logp (onehot - p) - g_H p (log p + H)) / T (module docstring), built in
    place in the fp32 logits' buffer: two [c, V] fp32 alive."""
    z = z_cV.float() / temperature
    z.sub_(torch.logsumexp(z, dim=-1, keepdim=True))  # z is log p now
    p = z.exp()
    if with_entropy:
        z.add_(ent_c[:, None]).mul_(p).mul_(-g_ent_c[:, None])
    else:
        z.zero_()
    g_z = z.addcmul_(p, g_logp_c[:, None], value=-1.0)
    del p
    g_z.scatter_add_(-1, tgt_c[:, None], g_logp_c[:, None])
    return g_z.div_(temperature).to(z_cV.dtype)
