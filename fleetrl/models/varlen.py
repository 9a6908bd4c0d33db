"""Packed-row attention as variable-length segments (`actor.packed_attention: varlen`, the native forward's GPU
default with `actor.share_prompts`): torch's own FlashAttention varlen kernel
(`torch.nn.attention.varlen.varlen_attn`) instead of a flex-attention BlockMask.

Why: with shared prompts (models/packing.py) a packed row is [prompt, response 1, ..., response n] per group, and
a response must see its prompt and itself but not its siblings. As a flex BlockMask that is many partial blocks
(segments do not start on 128-token boundaries): measured on an H200, flex attention took 180 ms of a 553 ms
update against 34 ms for cuDNN's flash kernel on the padded layout (bench/RESULTS.md). Here every segment is its
own varlen sequence: its queries are its tokens, its keys are its doc's prompt (for a response) followed by its own
tokens, gathered into a key row per segment (K/V are the small GQA heads, so the gather is cheap). A causal flash
kernel with queries shorter than keys aligns the mask bottom-right (query i sees keys up to i + k_len - q_len),
which is exactly "the whole prompt, then my own earlier tokens".

On CPU (tests) the same segments run through SDPA one at a time with that bottom-right causal mask: slow, exact,
and it checks the segment construction the GPU kernel shares.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fleetrl.batch import upload

try:  # torch >= 2.10
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # pragma: no cover - older torch: the native forward falls back to flex
    varlen_attn = None

_PARAMS = set(inspect.signature(varlen_attn).parameters) if varlen_attn is not None else set()


def available(device: torch.device) -> bool:
    return varlen_attn is not None and device.type == "cuda"


@dataclass(frozen=True)
class VarlenSegments:
    """The segments of one packed row: segment s has queries [q_cu[s], q_cu[s+1]) of the row and keys
    kv_index[k_cu[s]:k_cu[s+1]] (row indices). max_q / max_k: bounds of the lengths, which a compiled layer takes
    as constants: a fixed floor (the longest sample the run can make) keeps them to one value, so a long-tailed
    run does not recompile per micro-batch (measured: 7.9 s updates against 1.1 s while it did). The segment and
    key counts change with every micro-batch; their tensors are marked dynamic on every copy (`__post_init__`,
    `segments` says why)."""

    q_cu: torch.Tensor      # [S+1] int32
    k_cu: torch.Tensor      # [S+1] int32
    kv_index: torch.Tensor  # [K] long
    max_q: int
    max_k: int

    def __post_init__(self) -> None:
        for t in (self.q_cu, self.k_cu, self.kv_index):
            torch._dynamo.mark_dynamic(t, 0)

    def to(self, device: torch.device | str) -> "VarlenSegments":
        """The same segments on `device`, queued (`upload`): built on the host, they cost the GPU no wait."""
        return VarlenSegments(upload(self.q_cu, device), upload(self.k_cu, device), upload(self.kv_index, device),
                              self.max_q, self.max_k)


@dataclass(frozen=True)
class SegmentRuns:
    """A packed row's segments (`segment_runs`): segment s has queries [start, start + q_len)
    of the row and keys kv_index[k_start : k_start + k_len] (row indices: its doc's prompt first for a response)."""

    start_S: torch.Tensor    # [S] long
    q_len_S: torch.Tensor    # [S] long
    k_start_S: torch.Tensor  # [S] long
    k_len_S: torch.Tensor    # [S] long
    kv_index: torch.Tensor   # [K] long


def segment_runs(doc_N: torch.Tensor, seg_N: torch.Tensor) -> SegmentRuns:
    """From a packed row's doc / segment ids (models/packing.py `Packed`): a segment is a run of one (doc, seg);
    a seg-0 run (a prompt, or the alignment pad) attends to itself, any other run to its doc's seg-0 run first.
    Packing puts each doc's prompt first, so its seg-0 run is the doc's first run."""
    N = doc_N.shape[0]
    new = torch.ones(N, dtype=torch.bool, device=doc_N.device)
    new[1:] = (doc_N[1:] != doc_N[:-1]) | (seg_N[1:] != seg_N[:-1])
    start_S = torch.nonzero(new).flatten()
    q_len_S = torch.diff(start_S, append=start_S.new_tensor([N]))
    doc_S, is_prompt_S = doc_N[start_S], seg_N[start_S] == 0
    prompt_start_D = torch.zeros(int(doc_N.max()) + 1, dtype=torch.long, device=doc_N.device)
    prompt_len_D = torch.zeros_like(prompt_start_D)
    prompt_start_D[doc_S[is_prompt_S]] = start_S[is_prompt_S]
    prompt_len_D[doc_S[is_prompt_S]] = q_len_S[is_prompt_S]
    prefix_S = torch.where(is_prompt_S, 0, prompt_len_D[doc_S])
    k_len_S = prefix_S + q_len_S
    k_start_S = k_len_S.cumsum(0) - k_len_S
    # Key t of segment s: prefix token t (t < prefix), else its own token t - prefix.
    seg_K = torch.repeat_interleave(torch.arange(len(start_S), device=doc_N.device), k_len_S)
    t_K = torch.arange(int(k_len_S.sum()), device=doc_N.device) - k_start_S[seg_K]
    kv_index = torch.where(t_K < prefix_S[seg_K], prompt_start_D[doc_S[seg_K]] + t_K,
                           start_S[seg_K] + t_K - prefix_S[seg_K])
    return SegmentRuns(start_S, q_len_S, k_start_S, k_len_S, kv_index)


def segments(doc_N: torch.Tensor, seg_N: torch.Tensor, floor: int = 0) -> VarlenSegments:
    """The varlen kernel's segments of a packed row (`segment_runs`). floor: max_q / max_k while every segment fits
    under it (a longer one raises them to its power of two: correct, at the cost of a recompile).

    The offsets and key indices are marked dynamic along their length (on every copy: `VarlenSegments`). Why: a
    compiled layer otherwise takes every tensor's size as a constant, and a long-tailed micro-batch has a new
    segment count each time. Padding the counts to powers of two still left five sizes (8 to 128 segments), each
    a ~5 s compile inside a timed step, and the padding's empty segments are blocks the kernel launches for
    nothing (measured on an H200, bench/RESULTS.md, ninth round)."""
    runs = segment_runs(doc_N, seg_N)
    zero = runs.q_len_S.new_zeros(1)
    q_cu = torch.cat([zero, runs.q_len_S.cumsum(0)]).int()
    k_cu = torch.cat([zero, runs.k_len_S.cumsum(0)]).int()
    max_q, max_k = (int(x) for x in torch.stack([runs.q_len_S.max(), runs.k_len_S.max()]).tolist())
    return VarlenSegments(q_cu, k_cu, runs.kv_index, _bound(max_q, floor), _bound(max_k, floor))


def attend(q_1HNQ: torch.Tensor, k_1GNQ: torch.Tensor, v_1GNQ: torch.Tensor, seg: VarlenSegments) -> torch.Tensor:
    """[1, H, N, Q] attention output of a packed row's queries over their segments' keys (G KV heads)."""
    q_NHQ = q_1HNQ[0].transpose(0, 1)
    k_KGQ = _gather_rows(k_1GNQ[0].transpose(0, 1), seg.kv_index)
    v_KGQ = _gather_rows(v_1GNQ[0].transpose(0, 1), seg.kv_index)
    run = _kernel if q_NHQ.is_cuda and varlen_attn is not None else _reference
    return run(q_NHQ, k_KGQ, v_KGQ, seg).transpose(0, 1)[None]


def _gather_rows(x_N: torch.Tensor, index_K: torch.Tensor) -> torch.Tensor:
    """x_N[index_K] along dim 0, through an fp32 copy. Why: a prompt's rows are gathered once per response, so the
    backward sums repeated rows with atomic adds, which CUDA does natively in fp32 but by compare-and-swap loops in
    bf16 (measured on an H200: 21 ms of a 444 ms update). The forward is exact either way; the backward now rounds
    each row's sum once instead of after every add."""
    return x_N.float().index_select(0, index_K).to(x_N.dtype)


def _kernel(q_NHQ: torch.Tensor, k_KGQ: torch.Tensor, v_KGQ: torch.Tensor, seg: VarlenSegments) -> torch.Tensor:
    kw: dict = {}
    if "enable_gqa" in _PARAMS:
        kw["enable_gqa"] = True
    elif k_KGQ.shape[1] != q_NHQ.shape[1]:  # a torch whose kernel wants one KV head per query head
        group = q_NHQ.shape[1] // k_KGQ.shape[1]
        k_KGQ, v_KGQ = k_KGQ.repeat_interleave(group, 1), v_KGQ.repeat_interleave(group, 1)
    if "is_causal" in _PARAMS:
        kw["is_causal"] = True
    else:
        kw["window_size"] = (-1, 0)  # causal: no look-ahead
    return varlen_attn(q_NHQ.contiguous(), k_KGQ.contiguous(), v_KGQ.contiguous(), seg.q_cu, seg.k_cu,
                       seg.max_q, seg.max_k, **kw)


def _reference(q_NHQ: torch.Tensor, k_KGQ: torch.Tensor, v_KGQ: torch.Tensor, seg: VarlenSegments) -> torch.Tensor:
    """Segment by segment through SDPA with the bottom-right causal mask the flash kernel applies."""
    group = q_NHQ.shape[1] // k_KGQ.shape[1]
    out = []
    q_cu, k_cu = seg.q_cu.tolist(), seg.k_cu.tolist()
    for s in range(len(q_cu) - 1):
        q = q_NHQ[q_cu[s]:q_cu[s + 1]].transpose(0, 1)
        k = k_KGQ[k_cu[s]:k_cu[s + 1]].transpose(0, 1).repeat_interleave(group, 0)
        v = v_KGQ[k_cu[s]:k_cu[s + 1]].transpose(0, 1).repeat_interleave(group, 0)
        lq, lk = q.shape[1], k.shape[1]
        mask = torch.arange(lk, device=q.device)[None, :] <= torch.arange(lq, device=q.device)[:, None] + (lk - lq)
        out.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(0, 1))
    return torch.cat(out)


def _bound(n: int, floor: int) -> int:
    """The length bound the kernel is given: the floor while n fits under it (one value for the whole run), else n's
    power of two. Not max(floor, pow2(n)): with a floor of 1,184 (prompt 160 + response 1,024) a 1,150-key segment
    would have made it 2,048, a second compiled graph."""
    return floor if n <= floor else _pow2(n)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()
