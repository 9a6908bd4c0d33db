"""Packed-row attention on CPU as padded segments (`actor.packed_attention: segments`, the native forward's CPU
default under `auto`).

Why: a packed row's dense block-diagonal mask (models/decoder.py `packed_mask`) makes CPU SDPA visit every
(query, key) pair of the row although few may attend: in a GRPO row of two groups (704 tokens, 8 responses of
20-48 tokens per 50-token prompt) 20% of the 496k pairs are kept, and torch's CPU flash backward ran at ~90 GFLOP/s
on it. Measured on the 2-core VM for one bf16 layer's attention (9 query heads, 3 KV heads, head dim 64), forward
+ backward, compiled: 35 ms dense against 7.8 ms here (bench/RESULTS.md, "Eleventh session").

Layout: the segments of models/varlen.py (a prompt, or the alignment pad, attends to itself; a response to its
doc's prompt, then to itself), each padded to the longest: queries [S, Lq], keys [S, Lk], and one batched
matmul-softmax-matmul with a bool mask [S, 1, Lq, Lk] (bottom-right causal: query i of a segment whose keys start
with a p-token prefix sees keys j <= i + p). The scores are fp32, as the CPU flash kernel accumulates them; the
probabilities meet V in the activations' dtype. GQA: the query heads of a KV head are stacked as rows of that
head, so K/V are never repeated. A pad query row sees key 0 only (no all-masked softmax, no NaN); its output is
never read back, so its gradient is 0.

When padding would cost more than the dense mask (one long segment among many short ones), `build` returns None
and the caller keeps the dense mask.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fleetrl.models.varlen import segment_runs


@dataclass(frozen=True)
class PaddedSegments:
    """A packed row's attention pattern as S segments padded to Lq queries and Lk keys (row indices; 0 at pads)."""

    q_index_SL: torch.Tensor    # [S, Lq] long: the row of each query slot
    k_index_SK: torch.Tensor    # [S, Lk] long: the row of each key slot
    allowed_S1LK: torch.Tensor  # [S, 1, Lq, Lk] bool: True = attend
    out_index_N: torch.Tensor   # [N] long: the query slot (s * Lq + i) that holds row n's output


def build(doc_N: torch.Tensor, seg_N: torch.Tensor) -> PaddedSegments | None:
    """The padded segments of a packed row from its doc / segment ids (models/packing.py `Packed`), or None when
    they would hold more (query, key) pairs than the dense N x N mask."""
    N = doc_N.shape[0]
    runs = segment_runs(doc_N, seg_N)
    q_len_S, k_len_S = runs.q_len_S, runs.k_len_S
    Lq, Lk = int(q_len_S.max()), int(k_len_S.max())
    S = q_len_S.shape[0]
    if S * Lq * Lk > N * N:
        return None
    i_L, j_K = torch.arange(Lq, device=doc_N.device), torch.arange(Lk, device=doc_N.device)
    q_valid_SL = i_L[None] < q_len_S[:, None]
    k_valid_SK = j_K[None] < k_len_S[:, None]
    q_index_SL = torch.where(q_valid_SL, runs.start_S[:, None] + i_L[None], 0)
    k_pos_SK = (runs.k_start_S[:, None] + j_K[None]).clamp(max=runs.kv_index.shape[0] - 1)
    k_index_SK = torch.where(k_valid_SK, runs.kv_index[k_pos_SK], 0)
    prefix_S = k_len_S - q_len_S
    causal_SLK = j_K[None, None, :] <= i_L[None, :, None] + prefix_S[:, None, None]
    allowed_SLK = torch.where(q_valid_SL[:, :, None], causal_SLK & k_valid_SK[:, None, :], j_K[None, None, :] == 0)
    seg_of_N = torch.repeat_interleave(torch.arange(S, device=doc_N.device), q_len_S)
    out_index_N = seg_of_N * Lq + torch.arange(N, device=doc_N.device) - runs.start_S[seg_of_N]
    return PaddedSegments(q_index_SL, k_index_SK, allowed_SLK[:, None], out_index_N)


def attend(q_1HNQ: torch.Tensor, k_1GNQ: torch.Tensor, v_1GNQ: torch.Tensor, seg: PaddedSegments) -> torch.Tensor:
    """[1, H, N, Q] attention output of a packed row's queries over their segments' keys (G KV heads)."""
    S, Lq = seg.q_index_SL.shape
    Lk = seg.k_index_SK.shape[1]
    H, G, Q = q_1HNQ.shape[1], k_1GNQ.shape[1], q_1HNQ.shape[3]
    group = H // G
    q_SGRQ = (q_1HNQ[0].transpose(0, 1).index_select(0, seg.q_index_SL.flatten())  # [S*Lq, H, Q]
              .view(S, Lq, G, group, Q).permute(0, 2, 3, 1, 4).reshape(S, G, group * Lq, Q))
    k_SGKQ = k_1GNQ[0].transpose(0, 1).index_select(0, seg.k_index_SK.flatten()).view(S, Lk, G, Q).transpose(1, 2)
    v_SGKQ = v_1GNQ[0].transpose(0, 1).index_select(0, seg.k_index_SK.flatten()).view(S, Lk, G, Q).transpose(1, 2)
    acc = torch.promote_types(q_1HNQ.dtype, torch.float32)  # fp32 scores for bf16 (fp64 stays fp64)
    with torch.autocast(q_1HNQ.device.type, enabled=False):  # even inside the update's bf16 autocast
        scores = (q_SGRQ.to(acc) @ k_SGKQ.to(acc).transpose(-1, -2)) * Q ** -0.5
        scores = scores.view(S, G, group, Lq, Lk).masked_fill(~seg.allowed_S1LK[:, :, None], float("-inf"))
        o_SGRQ = scores.softmax(-1).view(S, G, group * Lq, Lk).to(v_SGKQ.dtype) @ v_SGKQ
    o_NHQ = o_SGRQ.view(S, G, group, Lq, Q).permute(0, 3, 1, 2, 4).reshape(S * Lq, H, Q).index_select(0, seg.out_index_N)
    return o_NHQ.transpose(0, 1)[None]
