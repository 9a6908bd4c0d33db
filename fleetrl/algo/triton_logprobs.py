"""Log-probs of the sampled tokens (and the entropy, as a metric) from LM-head logits in two Triton passes.

Why: with the head's logits in hand ([N, V], bf16 under autocast), the torch path upcasts them to fp32, divides
by the temperature, takes log_softmax, gathers, and for the entropy runs softmax, multiply and sum: each a full
pass over N x V fp32 values, and backward as many again. For Qwen2.5's 152k vocabulary and a 16k-token
micro-batch that is ~10 GB per pass; the profile of the 0.5B e2e update on an H200 put ~1/3 of the update there
(bench/RESULTS.md). Here:

  forward   one program per row streams the row once in blocks of BLOCK_V, keeping the online softmax state
            (running max m, S = sum exp(z - m), A = sum exp(z - m) z with z = logit / T) and the target's z:
            logp = z_t - m - log S, entropy = m + log S - A / S. It stores lse = m + log S per row (fp32).
  backward  one program per row writes d logits = g (onehot(t) - exp(z - lse)) / T in the logits' dtype, which
            the head's matmul backward consumes (under autocast it casts to bf16 anyway).

The entropy comes back detached (the `return_entropy="metric"` case); an entropy *bonus* needs its gradient and
takes the torch path. Statistics in fp32 as in the torch path, so results agree to fp32 rounding.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 2048


@triton.jit
def _forward_kernel(z_ptr, t_ptr, logp_ptr, ent_ptr, lse_ptr, V, stride, inv_t, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = z_ptr + row * stride
    target = tl.load(t_ptr + row)
    z_t = tl.load(base + target).to(tl.float32) * inv_t
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    a = tl.zeros((), tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32) * inv_t
        m_new = tl.maximum(m, tl.max(z, 0))
        scale = tl.exp(m - m_new)
        e = tl.exp(z - m_new)
        s = s * scale + tl.sum(e, 0)
        a = a * scale + tl.sum(e * tl.where(cols < V, z, 0.0), 0)  # masked: e = 0 and z = 0, not 0 * -inf
        m = m_new
    log_s = tl.log(s)
    tl.store(logp_ptr + row, z_t - m - log_s)
    tl.store(ent_ptr + row, m + log_s - a / s)
    tl.store(lse_ptr + row, m + log_s)


@triton.jit
def _backward_kernel(z_ptr, t_ptr, g_ptr, lse_ptr, dz_ptr, V, stride, inv_t, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = z_ptr + row * stride
    target = tl.load(t_ptr + row)
    g = tl.load(g_ptr + row) * inv_t
    lse = tl.load(lse_ptr + row)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = tl.load(base + cols, mask=cols < V, other=0.0).to(tl.float32) * inv_t
        d = g * (tl.where(cols == target, 1.0, 0.0) - tl.exp(z - lse))
        tl.store(dz_ptr + row * V + cols, d.to(dz_ptr.dtype.element_ty), mask=cols < V)


class _LogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_NV: torch.Tensor, targets_N: torch.Tensor,  # noqa: ANN001
                temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        n, v = logits_NV.shape
        logp = torch.empty(n, device=logits_NV.device, dtype=torch.float32)
        ent, lse = torch.empty_like(logp), torch.empty_like(logp)
        targets = targets_N.long().contiguous()
        if n:
            _forward_kernel[(n,)](logits_NV, targets, logp, ent, lse, v, logits_NV.stride(0), 1.0 / temperature,
                                  BLOCK=BLOCK_V)
        ctx.save_for_backward(logits_NV, targets, lse)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, _grad_ent: torch.Tensor):  # noqa: ANN001, ANN205
        logits_NV, targets, lse = ctx.saved_tensors
        n, v = logits_NV.shape
        grad = torch.empty((n, v), device=logits_NV.device, dtype=logits_NV.dtype)
        if n:
            _backward_kernel[(n,)](logits_NV, targets, grad_logp.float().contiguous(), lse, grad, v,
                                   logits_NV.stride(0), 1.0 / ctx.temperature, BLOCK=BLOCK_V)
        return grad, None, None


def logprobs_from_logits(logits_NV: torch.Tensor, targets_N: torch.Tensor,
                         temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp_N fp32, differentiable in the logits; entropy_N fp32, detached) of log softmax(logits / T).
    logits: [N, V] with unit stride along V (any float dtype), on a device Triton runs on."""
    if logits_NV.stride(-1) != 1:
        logits_NV = logits_NV.contiguous()
    return _LogProbs.apply(logits_NV, targets_N, temperature)
