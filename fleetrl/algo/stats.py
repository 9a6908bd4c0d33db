"""Masked reductions over padded [B, T] token tensors.

Masks are 0/1 (bool, int or float). Masked-out positions are selected away with `torch.where` rather than
multiplied by 0, so a NaN or inf sitting in padding (e.g. a log-prob of a pad token) cannot leak into a sum.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of `x` where `mask` is 1. x, mask: same shape (e.g. [B, T]); dim None -> scalar."""
    kept = torch.where(mask.bool(), x, torch.zeros_like(x))
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `x` over positions where `mask` is 1; an all-zero mask gives 0, not NaN.

    x, mask: same shape; dim None -> scalar, else that dimension is reduced.
    """
    count = masked_sum(torch.ones_like(x), mask, dim)
    # A sequence with no response tokens (e.g. truncated prompt) must not turn the whole batch into NaN.
    return masked_sum(x, mask, dim) / count.clamp_min(1)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of the masked entries of `x` (all dimensions), as a scalar.

    unbiased=True applies Bessel's correction n / (n - 1), like `torch.var`; with n <= 1 the result is 0.
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if not unbiased:
        return var
    n = masked_sum(torch.ones_like(x), mask)
    # n / max(n - 1, 1) keeps n == 1 at factor 1 (var is 0 there) without a branch or a host sync.
    return var * n / (n - 1).clamp_min(1)


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8,
                  sum_all: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """(x - mean) / sqrt(var + eps) over the masked entries; zero where `mask` is 0.

    x, mask: same shape (e.g. [B, T]). Statistics are taken over the whole tensor, not per row.
    shift_mean=False adds the mean back, i.e. only rescales (used for values-like quantities).
    sum_all: sums a tensor over the data-parallel ranks when this rank holds only part of the batch (the
    rank-local step): mean and unbiased variance then come from the global count, sum and sum of squares, in
    float64 (one all-reduce of three numbers). None: this tensor is the whole batch (the two-pass formula).
    """
    if sum_all is None:
        mean = masked_mean(x, mask)
        var = masked_var(x, mask, unbiased=True)
    else:
        keep = mask.bool()
        x64 = torch.where(keep, x.to(torch.float64), torch.zeros((), dtype=torch.float64, device=x.device))
        n, total, squares = sum_all(torch.stack([keep.sum().to(torch.float64), x64.sum(), (x64 * x64).sum()])).unbind()
        mean64 = total / n.clamp_min(1)
        var64 = (squares - n * mean64 * mean64).clamp_min(0) / (n - 1).clamp_min(1)
        mean, var = mean64.to(x.dtype), var64.to(x.dtype)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask.bool(), out, torch.zeros_like(out))
