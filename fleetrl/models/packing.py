"""Packed training forward: the samples of a micro-batch concatenated into one row, no padding.

Layout in (fleetrl/batch.py): prompts [B, P] left-padded, responses [B, R] right-padded. Packed: the real
tokens of sample 0 (prompt then response), then those of sample 1, ..., in one row [1, N] with position ids
restarting at 0 for every sample. transformers (masking_utils.find_packed_sequence_indices) reads a position
id that does not follow its predecessor by +1 as a sequence start when attention_mask is None, and builds a
mask that never crosses samples: block-diagonal causal for eager/sdpa (dense N x N: fine on CPU and in tests)
and a block-sparse BlockMask for flex_attention (GPU: work proportional to the real tokens).

The row is padded to a multiple of PACK_ALIGN tokens (one extra "sample" of pad ids, its outputs dropped), so
the compiled flex-attention kernel sees few distinct shapes.

Semantics match `sequence_logprobs` on the padded layout: a token's position is its index among its sample's
real tokens (cumsum(mask) - 1), keys are the sample's real tokens up to it, and response token r is predicted
by the hidden state of the real token before it.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from fleetrl.algo.fused_logprobs import fused_logprobs_entropy
from fleetrl.models.logprobs import EntropyMode, _chunk_stats, _lm_head, check_head_only

PACK_ALIGN = 128  # flex attention's default block size


@dataclass(frozen=True)
class Packed:
    """One micro-batch packed into a row. N = real tokens + alignment pad, M = response tokens."""

    input_ids_1N: torch.Tensor
    position_ids_1N: torch.Tensor
    pred_index_M: torch.Tensor   # [M] index into N of the hidden state that predicts each response token
    targets_M: torch.Tensor      # [M] the response tokens
    response_keep_BR: torch.Tensor  # [B, R] bool, True at the M response tokens (row-major order)
    real_tokens: int


def pack(prompts_BP: torch.Tensor, prompt_mask_BP: torch.Tensor, responses_BR: torch.Tensor,
         response_mask_BR: torch.Tensor, align: int = PACK_ALIGN) -> Packed:
    """Packs the real tokens (mask 1) of every sample into one row; see the module docstring."""
    ids_BL = torch.cat([prompts_BP, responses_BR], dim=1)
    keep_BL = torch.cat([prompt_mask_BP, response_mask_BR], dim=1).bool()
    if not bool(prompt_mask_BP.bool().any(1).all()):
        raise ValueError("pack: every sample needs at least one prompt token (e.g. BOS) to condition its first "
                         "response token on; a row of prompt_mask is all 0")
    pos_BL = keep_BL.long().cumsum(1) - 1
    packed_index_BL = keep_BL.flatten().long().cumsum(0).view_as(keep_BL) - 1  # index in the packed row
    n = int(keep_BL.sum())
    pad = (-n) % align
    input_ids = torch.cat([ids_BL[keep_BL], ids_BL.new_zeros(pad)])
    positions = torch.cat([pos_BL[keep_BL], torch.arange(pad, device=pos_BL.device)])
    P = prompts_BP.shape[1]
    resp_keep_BR = keep_BL[:, P:]
    return Packed(input_ids_1N=input_ids[None], position_ids_1N=positions[None],
                  pred_index_M=packed_index_BL[:, P:][resp_keep_BR] - 1, targets_M=responses_BR[resp_keep_BR],
                  response_keep_BR=resp_keep_BR, real_tokens=n)


def packed_logprobs(model: nn.Module, prompts_BP: torch.Tensor, prompt_mask_BP: torch.Tensor,
                    responses_BR: torch.Tensor, response_mask_BR: torch.Tensor, *, temperature: float = 1.0,
                    return_entropy: EntropyMode = False, fused_chunk: int | None = None,
                    attention: str | None = None, align: int = PACK_ALIGN) -> tuple[torch.Tensor, torch.Tensor | None]:
    """As `sequence_logprobs` ([B, R] fp32 log-probs and entropy, 0 where masked), from one packed forward.

    fused_chunk: tokens per chunk of the fused projection + log-softmax (algo/fused_logprobs.py); None = the
    LM head over all M response tokens at once. attention: the transformers attention implementation for this
    forward (None = the model's own; packing needs eager, sdpa or flex_attention). align: the row is padded to a
    multiple of it.
    """
    if temperature <= 0:
        raise ValueError(f"packed_logprobs: temperature must be > 0, got {temperature}")
    check_head_only(model, "packed_logprobs")
    pk = pack(prompts_BP, prompt_mask_BP, responses_BR, response_mask_BR, align=align)
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
    logp_BR = unpack_tokens(logp_M, pk.response_keep_BR)
    return logp_BR, (unpack_tokens(ent_M, pk.response_keep_BR) if return_entropy else None)


def unpack_tokens(x_M: torch.Tensor, keep_BR: torch.Tensor) -> torch.Tensor:
    """[M] values at the True cells of keep_BR (row-major) -> [B, R] fp32 with 0 elsewhere; differentiable."""
    out = torch.zeros(keep_BR.shape, dtype=torch.float32, device=x_M.device)
    return out.masked_scatter(keep_BR, x_M.float())


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

    @staticmethod
    def choose_attention(name: str, device: torch.device) -> str | None:
        """`auto`: flex_attention on GPU (block-sparse, real tokens only), the model's own elsewhere."""
        if name != "auto":
            return name
        return "flex_attention" if device.type == "cuda" else None

    def __call__(self, model: nn.Module, prompts_BP: torch.Tensor, prompt_mask_BP: torch.Tensor,
                 responses_BR: torch.Tensor, response_mask_BR: torch.Tensor, *, temperature: float,
                 return_entropy: EntropyMode) -> tuple[torch.Tensor, torch.Tensor | None]:
        return packed_logprobs(model, prompts_BP, prompt_mask_BP, responses_BR, response_mask_BR,
                               temperature=temperature, return_entropy=return_entropy, fused_chunk=self.fused_chunk,
                               attention=self.attention, align=self.row_align)

    @property
    def row_align(self) -> int:
        """flex_attention compiles a kernel (and its block mask) per row length, ~tens of seconds each on an H200:
        measured, a 6-step e2e with rows rounded to 128 was still compiling after 240 s. So with flex every row is
        padded to the budget itself (one shape; an oversized single sample takes a multiple of it), trading the
        unfilled tail of the last micro-batch for a single compile. Elsewhere rows round up to PACK_ALIGN."""
        if self.attention == "flex_attention":
            return -(-self.max_tokens // PACK_ALIGN) * PACK_ALIGN
        return PACK_ALIGN

    def token_slots(self, prompt_mask_BP: torch.Tensor, response_mask_BR: torch.Tensor) -> tuple[int, int]:
        """(real tokens, token slots the packed forward computes: real rounded up to `row_align`)."""
        real = int(prompt_mask_BP.sum() + response_mask_BR.sum())
        return real, real + (-real) % self.row_align
