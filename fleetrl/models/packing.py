"""Packed training forward: the samples of a micro-batch concatenated into one row, no padding.

Layout in (fleetrl/batch.py): prompts [B, P] left-padded, responses [B, R] right-padded. Packed: the real
tokens of sample 0 (prompt then response), then those of sample 1, ..., in one row [1, N] with position ids
restarting at 0 for every sample. transformers (masking_utils.find_packed_sequence_indices) reads a position
id that does not follow its predecessor by +1 as a sequence start when attention_mask is None, and builds a
mask that never crosses samples: block-diagonal causal for eager/sdpa (dense N x N: fine on CPU and in tests)
and a block-sparse BlockMask for flex_attention (GPU: work proportional to the real tokens).

The row is padded to a multiple of PACK_ALIGN tokens (extra "samples" of pad ids, cut at the row's PACK_ALIGN
boundaries, their outputs dropped), so the compiled flex-attention kernel sees few distinct shapes.

Semantics match `sequence_logprobs` on the padded layout: a token's position is its index among its sample's
real tokens (cumsum(mask) - 1), keys are the sample's real tokens up to it, and response token r is predicted
by the hidden state of the real token before it.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Iterator, NamedTuple

import torch
from torch import nn

from fleetrl.algo.fused_logprobs import fused_logprobs_entropy
from fleetrl.batch import upload
from fleetrl.models.logprobs import EntropyMode, _chunk_stats, _lm_head, check_head_only

PACK_ALIGN = 128  # flex attention's default block size
CPU_ALIGN = 16  # rows on CPU: 8 groups of SmolLM2's arithmetic GRPO took 3,072 token slots at 128, 2,880 at 16


class HostRows(NamedTuple):
    """A micro-batch's four layout tensors on the host (CPU), which a packed row is built from before it is queued
    to the GPU (`Packed.to`): built there, it would read device values back (native.py `_row_and_mask`)."""

    prompts_BP: torch.Tensor
    prompt_mask_BP: torch.Tensor
    responses_BR: torch.Tensor
    response_mask_BR: torch.Tensor


@dataclass(frozen=True)
class Packed:
    """One micro-batch packed into a row. N = packed tokens + alignment pad, M = response tokens.

    doc_N / seg_N say who may attend to whom (models/decoder.py `packed_mask`): a query sees the earlier keys
    of its own doc whose segment is 0 (the doc's prompt) or its own. A doc is one sample, or with shared prompts
    one prompt followed by the responses of the samples that have it; prompts are segment 0, each response its
    own segment."""

    input_ids_1N: torch.Tensor
    position_ids_1N: torch.Tensor
    pred_index_M: torch.Tensor   # [M] index into N of the hidden state that predicts each response token
    targets_M: torch.Tensor      # [M] the response tokens
    response_keep_BR: torch.Tensor  # [B, R] bool, True at the M response tokens (row-major order)
    real_tokens: int             # tokens the forward computes, alignment pad excluded
    doc_N: torch.Tensor          # [N] doc id: a sample, or a shared prompt and its samples' responses
    seg_N: torch.Tensor          # [N] 0 = the doc's prompt, else the response's own id
    response_index_M: torch.Tensor  # [M] flat index into [B * R] of each response token (`unpack_tokens`)

    def to(self, device: torch.device | str) -> "Packed":
        """The same row on `device`, every tensor through `upload` (queued; the host does not wait for the GPU)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return Packed(**{k: upload(v, device) if isinstance(v, torch.Tensor) else v for k, v in values.items()})


def same_prompt_as_previous(prompts_BP: torch.Tensor, prompt_mask_BP: torch.Tensor) -> torch.Tensor:
    """[B] bool: row b has exactly row b-1's prompt (tokens and mask). GRPO's n samples of a prompt are
    consecutive rows (the trainer repeats each prompt n times in place), so comparing neighbours finds them."""
    keyed_BP = prompts_BP * prompt_mask_BP  # pad slots compare equal whatever their id
    same_B = torch.zeros(prompts_BP.shape[0], dtype=torch.bool, device=prompts_BP.device)
    same_B[1:] = (keyed_BP[1:] == keyed_BP[:-1]).all(1) & (prompt_mask_BP[1:] == prompt_mask_BP[:-1]).all(1)
    return same_B


def pack(prompts_BP: torch.Tensor, prompt_mask_BP: torch.Tensor, responses_BR: torch.Tensor,
         response_mask_BR: torch.Tensor, align: int = PACK_ALIGN, share_prompts: bool = False) -> Packed:
    """Packs the real tokens (mask 1) of every sample into one row; see the module docstring. share_prompts:
    consecutive samples with the same prompt share one copy of it (their responses follow it, each attending to
    the prompt and to itself only), so GRPO's n samples of a prompt run it once."""
    ids_BL = torch.cat([prompts_BP, responses_BR], dim=1)
    keep_BL = torch.cat([prompt_mask_BP, response_mask_BR], dim=1).bool()
    if not bool(prompt_mask_BP.bool().any(1).all()):
        raise ValueError("pack: every sample needs at least one prompt token (e.g. BOS) to condition its first "
                         "response token on; a row of prompt_mask is all 0")
    B, P = prompts_BP.shape
    pos_BL = keep_BL.long().cumsum(1) - 1  # a token's position in its own sample, shared prompt or not
    follower_B = (same_prompt_as_previous(prompts_BP, prompt_mask_BP) if share_prompts
                  else torch.zeros(B, dtype=torch.bool, device=keep_BL.device))
    packed_BL = keep_BL.clone()
    packed_BL[:, :P] &= ~follower_B[:, None]  # a follower's prompt is its leader's, already in the row
    index_BL = packed_BL.flatten().long().cumsum(0).view_as(packed_BL) - 1  # index in the packed row
    doc_B = (~follower_B).long().cumsum(0) - 1
    leader_B = torch.nonzero(~follower_B).flatten()[doc_B]
    index_BL[:, :P] = index_BL[leader_B, :P]  # every sample reads its prompt where its leader put it
    # Response token r is predicted by the real token before it in its own sample: list each sample's real
    # tokens in order (row-major), and take the one before each response token (a prompt token always leads).
    seq_T = index_BL[keep_BL]
    is_resp_T = torch.zeros_like(keep_BL)
    is_resp_T[:, P:] = True
    pred_M = seq_T[torch.nonzero(is_resp_T[keep_BL]).flatten() - 1]
    n = int(packed_BL.sum())
    pad = (-n) % align
    input_ids = torch.cat([ids_BL[packed_BL], ids_BL.new_zeros(pad)])
    # The pad is cut into docs at the row's PACK_ALIGN boundaries (flex's blocks). Why: attention treats a pad doc
    # like a real one, quadratic in its length, and a row padded to the budget (flex: `PackedForward.row_align`)
    # can end in thousands of pad tokens; as one doc they also set the varlen kernel's length bound (a recompile
    # per new bound; varlen rows were padded to the budget too until the ninth round, bench/RESULTS.md). Cut, the
    # pad costs attention in proportion to its length, one block per doc.
    at_N = torch.arange(pad, device=pos_BL.device) + n % PACK_ALIGN  # offset in the pad's first block
    pad_doc = at_N // PACK_ALIGN
    positions = torch.cat([pos_BL[packed_BL], at_N % PACK_ALIGN - torch.where(pad_doc == 0, n % PACK_ALIGN, 0)])
    seg_BL = torch.zeros_like(pos_BL)
    seg_BL[:, P:] = torch.arange(1, B + 1, device=seg_BL.device)[:, None]
    doc_BL = doc_B[:, None].expand_as(pos_BL)
    tail = pad_doc + (int(doc_B[-1]) + 1 if B else 0)
    resp_keep_BR = keep_BL[:, P:]
    return Packed(input_ids_1N=input_ids[None], position_ids_1N=positions[None], pred_index_M=pred_M,
                  targets_M=responses_BR[resp_keep_BR], response_keep_BR=resp_keep_BR, real_tokens=n,
                  doc_N=torch.cat([doc_BL[packed_BL], tail]), seg_N=torch.cat([seg_BL[packed_BL], tail * 0]),
                  response_index_M=torch.nonzero(resp_keep_BR.flatten()).flatten())


def packed_logprobs(model: nn.Module, prompts_BP: torch.Tensor, prompt_mask_BP: torch.Tensor,
                    responses_BR: torch.Tensor, response_mask_BR: torch.Tensor, *, temperature: float = 1.0,
                    return_entropy: EntropyMode = False, fused_chunk: int | None = None,
                    attention: str | None = None, align: int = PACK_ALIGN,
                    host: HostRows | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """As `sequence_logprobs` ([B, R] fp32 log-probs and entropy, 0 where masked), from one packed forward.

    fused_chunk: tokens per chunk of the fused projection + log-softmax (algo/fused_logprobs.py); None = the
    LM head over all M response tokens at once. attention: the transformers attention implementation for this
    forward (None = the model's own; packing needs eager, sdpa or flex_attention). align: the row is padded to a
    multiple of it. host: CPU copies of the four tensors, to pack on the host (native.py `_row_and_mask` says why).
    """
    if temperature <= 0:
        raise ValueError(f"packed_logprobs: temperature must be > 0, got {temperature}")
    check_head_only(model, "packed_logprobs")
    rows = host if host is not None else HostRows(prompts_BP, prompt_mask_BP, responses_BR, response_mask_BR)
    # HF's forward reads only the ids and positions; the doc / segment ids go up too, a few small copies
    pk = pack(*rows, align=align).to(prompts_BP.device)
    from fleetrl.models.value_head import backbone_of  # local import: value_head imports models.logprobs

    with attention_implementation(model, attention):
        # attention_mask=None is what makes transformers derive the per-sample mask from the position ids
        out = backbone_of(model)(input_ids=pk.input_ids_1N, position_ids=pk.position_ids_1N, attention_mask=None,
                                 use_cache=False)
    return packed_head_stats(model, out.last_hidden_state[0], pk, temperature=temperature,
                             return_entropy=return_entropy, fused_chunk=fused_chunk)


def packed_head_stats(model: nn.Module, hidden_ND: torch.Tensor, pk: Packed, *, temperature: float,
                      return_entropy: EntropyMode, fused_chunk: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, R] log-probs (and entropy) from the packed row's hidden states [N, D] (any backbone's)."""
    hidden_MH = hidden_ND.index_select(0, pk.pred_index_M)
    head = _lm_head(model)
    if fused_chunk is not None and getattr(head, "bias", None) is None:
        logp_M, ent_M = fused_logprobs_entropy(hidden_MH, head.weight, pk.targets_M, temperature=temperature,
                                               chunk=fused_chunk, return_entropy=bool(return_entropy))
    else:
        logp_M, ent_M = (t[0] for t in _chunk_stats(hidden_MH[None], pk.targets_M[None], head, temperature,
                                                    return_entropy))
    logp_BR = unpack_tokens(logp_M, pk.response_keep_BR, pk.response_index_M)
    return logp_BR, (unpack_tokens(ent_M, pk.response_keep_BR, pk.response_index_M) if return_entropy else None)


def unpack_tokens(x_M: torch.Tensor, keep_BR: torch.Tensor, index_M: torch.Tensor | None = None) -> torch.Tensor:
    """[M] values at the True cells of keep_BR (row-major) -> [B, R] fp32 with 0 elsewhere; differentiable.
    index_M: those cells' flat indices, when known (`Packed.response_index_M`). Why: masked_scatter's backward
    is a masked_select, whose output size the host must read, so the backward waits for the GPU there (found in
    a profile of the long-tailed update: a wait per micro-batch); a scatter by index backpropagates as a gather."""
    out = torch.zeros(keep_BR.shape, dtype=torch.float32, device=x_M.device)
    if index_M is None:
        return out.masked_scatter(keep_BR, x_M.float())
    return out.flatten().scatter(0, index_M, x_M.float()).view_as(out)


@contextmanager
def attention_implementation(model: nn.Module, name: str | None) -> Iterator[None]:
    """Sets the model config's attention implementation for one forward (HF layers read it at call time)."""
    config = getattr(model, "config", None)
    if name is None or config is None:
        yield
        return
    old = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = old


def padded_token_slots(prompt_mask_BP: torch.Tensor, response_mask_BR: torch.Tensor) -> tuple[int, int]:
    """(real tokens, token slots a padded forward of this (trimmed) micro-batch computes)."""
    real = int(prompt_mask_BP.sum() + response_mask_BR.sum())
    return real, int(prompt_mask_BP.numel() + response_mask_BR.numel())


@dataclass(frozen=True, kw_only=True)
class PackedForward:
    """The packed-forward settings of a role (from the Plan and actor config), callable on a micro-batch."""

    max_tokens: int
    fused_chunk: int | None = None
    attention: str | None = None  # None = the model's own implementation
    # One copy of a prompt per run of samples that share it (native forward only: HF's packed masks come from
    # position ids and cannot express it; config validation refuses the combination).
    share_prompts: bool = False
    # The longest sample the run can make (prompt + response limits): the varlen kernel's static length bound.
    max_segment: int = 0
    # Rows of a dense or the model's own attention round up to a multiple of this: few static shapes for a GPU
    # compile; on CPU (eager, or one dynamic-shape compile) every pad token is only waste (`CPU_ALIGN`).
    align: int = PACK_ALIGN

    @staticmethod
    def choose_attention(name: str, device: torch.device) -> str | None:
        """`auto`: flex_attention on GPU (block-sparse, real tokens only), the model's own elsewhere."""
        if name != "auto":
            return name
        return "flex_attention" if device.type == "cuda" else None

    def __call__(self, model: nn.Module, prompts_BP: torch.Tensor, prompt_mask_BP: torch.Tensor,
                 responses_BR: torch.Tensor, response_mask_BR: torch.Tensor, *, temperature: float,
                 return_entropy: EntropyMode, host: HostRows | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.share_prompts:
            raise ValueError("shared prompts in a packed row need actor.forward=native (HF derives its packed "
                             "attention mask from position ids, which cannot say 'this prompt, not that response')")
        return packed_logprobs(model, prompts_BP, prompt_mask_BP, responses_BR, response_mask_BR,
                               temperature=temperature, return_entropy=return_entropy, fused_chunk=self.fused_chunk,
                               attention=self.attention, align=self.row_align, host=host)

    @property
    def row_align(self) -> int:
        """flex_attention compiles a kernel (and its block mask) per row length, ~tens of seconds each on an H200:
        measured, a 6-step e2e with rows rounded to 128 was still compiling after 240 s. So with flex every row is
        padded to the budget itself (one shape; an oversized single sample takes a multiple of it), trading the
        unfilled tail of the last micro-batch for a single compile. Elsewhere rows round up to `align`: varlen
        rows too, whose length the compiled layer takes as a dynamic size (models/decoder.py `hidden`); padded to
        the budget they wasted 10-24% of a long-tailed step's tokens (bench/RESULTS.md, ninth round)."""
        if self.attention == "flex_attention":
            return -(-self.max_tokens // PACK_ALIGN) * PACK_ALIGN
        return self.align

    def token_slots(self, prompt_mask_BP: torch.Tensor, response_mask_BR: torch.Tensor,
                    prompts_BP: torch.Tensor | None = None) -> tuple[int, int]:
        """(real tokens, token slots the packed forward computes: real rounded up to `row_align`). With shared
        prompts (and `prompts_BP` given) a prompt counts once per run of samples that share it."""
        prompt_B = prompt_mask_BP.sum(1)
        if self.share_prompts and prompts_BP is not None:
            prompt_B = prompt_B * ~same_prompt_as_previous(prompts_BP, prompt_mask_BP)
        real = int(prompt_B.sum() + response_mask_BR.sum())
        return real, real + (-real) % self.row_align
