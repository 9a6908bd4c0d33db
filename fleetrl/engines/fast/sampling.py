"""On-device sampling with no host synchronisation, and the logprob the trainer recomputes.

Randomness is a pure function of (call seed, request index, token index), so a request's samples do not
depend on which slot or step it ran in, and a CUDA graph needs no generator state:
  * torch path (CPU; top-k/top-p on CUDA): one uniform u per row from an integer hash of the triple, then
    inverse-CDF sampling over the (filtered) unnormalised softmax e_i = exp(z_i - max z): token =
    #{i : cdf_i <= u * cdf_V}. Plain sampling holds one fp32 [n, V] buffer (the running sum, built in place).
    u has 24 bits and the running sums are fp32, so a token's probability is resolved to about 2^-24 (6e-8)
    of the total: tokens rarer than that are drawn with a quantised frequency.
  * Triton path (CUDA, no top-k/top-p), exact in two stages: pass 1 reads the logits once in the model dtype
    (per 4096-column block: max and sum of exp); pass 2, one program per row, picks a block by inverse CDF
    over the block masses with a 53-bit uniform in fp64, then a token within that block by the exponential
    race argmax_i p_i / E_i, E_i = -log U_i ~ Exp(1) (Gumbel-max in another form; Gumbel 1954), U from
    in-kernel Philox keyed by the same triple. P(i) = P(block) x P(i | block) = p_i up to fp32 rounding of
    the block masses. No fp32 [n, V] copy, and random numbers and logs for one block per row instead of
    every logit (the single-stage race it replaces drew them for all 152k columns; the profile put that
    sampler at ~0.18 ms of a 0.5B batch-256 step).
The reported logprob is log_softmax(logits / T) at the sampled id in fp32, over the UNfiltered logits, as the
protocol requires; greedy (T = 0) reports log_softmax(logits) (T = 1).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

_M32 = 0xFFFFFFFF


@dataclass(frozen=True, slots=True)
class SamplerKey:
    """The host-side constants of a sampling mode (part of the CUDA-graph key); temperature is a device scalar."""

    greedy: bool
    top_k: int = 0
    top_p: float = 1.0

    @property
    def filtered(self) -> bool:
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)


def _mix32(h: torch.Tensor) -> torch.Tensor:
    # murmur-style finaliser on values < 2^32 held in int64; constants < 2^31 keep every product < 2^63.
    h = ((h ^ (h >> 16)) * 0x5BD1E995) & _M32
    h = ((h ^ (h >> 15)) * 0x27D4EB2D) & _M32
    return h ^ (h >> 16)


def hash_uniform(seed: torch.Tensor, req: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """U[0, 1) float32 per row from the (seed [1], req [n], count [n]) triple, on their device."""
    h = _mix32(seed & _M32)
    h = _mix32((h ^ (req & _M32)) & _M32)
    h = _mix32((h ^ ((count * 0x9E37) & _M32)) & _M32)
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def filter_top_k_top_p(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """z [n, V] fp32 with everything outside the top-k and outside the smallest top-p nucleus set to -inf."""
    if top_k > 0 and top_k < z.shape[-1]:
        kth = torch.topk(z, top_k, dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        sorted_z, order = torch.sort(z, dim=-1, descending=True)
        probs = torch.softmax(sorted_z, dim=-1)
        # drop a token when the tokens strictly before it already reach top_p (the first one always stays)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        sorted_z = sorted_z.masked_fill(drop, float("-inf"))
        z = torch.empty_like(z).scatter_(-1, order, sorted_z)
    return z


def sample_torch(logits: torch.Tensor, key: SamplerKey, temperature: torch.Tensor, seed: torch.Tensor,
                 req: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [n, V] -> (token [n] long, logprob [n] fp32). Graph-safe: no host syncs, no boolean indexing.

    Plain sampling holds one fp32 [n, V] buffer: z = logits / T, turned in place into exp(z - max) and then its
    running sum, whose last column also gives the log-sum-exp (no separate softmax or logsumexp pass)."""
    if key.filtered:
        return _sample_filtered(logits, key, temperature, seed, req, count)
    z = logits.to(torch.float32, copy=True).div_(temperature)
    if key.greedy:
        lse = torch.logsumexp(z, dim=-1)
        tok = logits.argmax(dim=-1)  # T = 1 and fp32 holds every bf16/fp16 value: argmax(z) with its tie order
    else:
        peak = z.amax(dim=-1)
        cdf = z.sub_(peak[:, None]).exp_().cumsum_(dim=-1)
        total = cdf[:, -1]
        u = hash_uniform(seed, req, count) * total
        tok = torch.searchsorted(cdf, u[:, None], right=True).squeeze(1).clamp_(max=z.shape[-1] - 1)
        lse = peak + total.log()
    return tok, _picked(logits, tok, temperature) - lse


def _sample_filtered(logits: torch.Tensor, key: SamplerKey, temperature: torch.Tensor, seed: torch.Tensor,
                     req: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """top-k / top-p: inverse-CDF over the filtered softmax; the logprob stays over the UNfiltered logits."""
    z = logits.float() / temperature
    lse = torch.logsumexp(z, dim=-1)
    cdf = torch.cumsum(torch.softmax(filter_top_k_top_p(z, key.top_k, key.top_p), dim=-1), dim=-1)
    u = hash_uniform(seed, req, count) * cdf[:, -1]
    tok = torch.searchsorted(cdf, u[:, None], right=True).squeeze(1).clamp_(max=z.shape[-1] - 1)
    return tok, _picked(logits, tok, temperature) - lse


def _picked(logits: torch.Tensor, tok: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """logits[i, tok_i] / T in fp32: the same value as (logits.float() / T)[i, tok_i]."""
    return logits.gather(1, tok[:, None]).squeeze(1).float() / temperature


def sample(logits: torch.Tensor, key: SamplerKey, temperature: torch.Tensor, seed: torch.Tensor,
           req: torch.Tensor, count: torch.Tensor, kernels: Any | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatches to the fused Triton sampler when it applies (greedy or plain temperature sampling)."""
    if kernels is not None and not key.filtered:
        return kernels.sample(logits, temperature, seed, req, count, greedy=key.greedy)
    return sample_torch(logits, key, temperature, seed, req, count)


def is_stop(tok: torch.Tensor, stop_ids: torch.Tensor) -> torch.Tensor:
    """tok [n] -> bool [n]: tok is one of stop_ids (padding -1 never matches)."""
    return (tok[:, None] == stop_ids[None, :]).any(dim=-1)
