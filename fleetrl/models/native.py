"""Response log-probs through our own decoder forward (fleetrl/models/decoder.py), padded or packed.

Same contract as `sequence_logprobs` / `packed_logprobs`: [B, R] fp32 log-probs (and entropy), 0 where the
response mask is 0, from prompts [B, P] left-padded and responses [B, R] right-padded (fleetrl/batch.py).

Padded micro-batches are *compacted*: each row's real tokens (prompt mask 1, then response mask 1) move to its
front, in order, and the row is cut to a bucketed width. With no padding before or between real tokens, causal
attention with no mask is exactly "attend to this sample's earlier real tokens" (pads only trail, and no real
token looks ahead), so SDPA runs its flash kernel, and position ids are simply 0..L-1. Buckets (`bucket_length`)
keep the compiled layer to a few static shapes. A response token is predicted by the hidden state of the real
token before it, as in the packed path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fleetrl.algo.fused_logprobs import fused_logprobs_entropy
from fleetrl.batch import upload
from fleetrl.models.decoder import Mask, NativeDecoder, packed_mask
from fleetrl.models.logprobs import EntropyMode, _lm_head, check_head_only, head_stats
from fleetrl.models.packing import (
    PACK_ALIGN,
    HostRows,
    Packed,
    PackedForward,
    pack,
    packed_head_stats,
    unpack_tokens,
)


def bucket_length(n: int, floor: int = 64) -> int:
    """n rounded up to a quarter-octave bucket: for 2^k < n <= 2^(k+1), a multiple of 2^(k-2) (and of `floor`).
    E.g. 100 -> 128, 300 -> 320, 385 -> 448, 1100 -> 1280, 2049 -> 2560: at most 25% padding, at most 4 shapes
    per doubling of the longest sample (each a compile of the static-shape layer)."""
    step = max(floor, 1 << max((max(n, 1) - 1).bit_length() - 3, 0))
    return -(-max(n, 1) // step) * step


def compact_rows(prompts_BP: torch.Tensor, prompt_mask_BP: torch.Tensor, responses_BR: torch.Tensor,
                 response_mask_BR: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [B, width] with each row's real tokens first then 0s, pred_index [B, R]: the column whose hidden
    state predicts each response token; 0 where the response mask is 0)."""
    ids_BL = torch.cat([prompts_BP, responses_BR], dim=1)
    keep_BL = torch.cat([prompt_mask_BP, response_mask_BR], dim=1).bool()
    # A stable sort on "is pad" lists the real columns in order, then the pads.
    order_BL = torch.sort((~keep_BL).to(torch.uint8), dim=1, stable=True).indices
    ids_BL = (ids_BL * keep_BL).gather(1, order_BL)
    L = ids_BL.shape[1]
    ids_BW = ids_BL[:, :width] if width <= L else torch.cat([ids_BL, ids_BL.new_zeros(ids_BL.shape[0], width - L)], 1)
    compact_BL = keep_BL.long().cumsum(1) - 1  # a real token's column after compaction
    P = prompts_BP.shape[1]
    pred_BR = ((compact_BL[:, P:] - 1) * response_mask_BR.bool()).clamp(min=0)
    return ids_BW, pred_BR


def padded_native_logprobs(decoder: NativeDecoder, model: nn.Module, prompts_BP: torch.Tensor,
                           prompt_mask_BP: torch.Tensor, responses_BR: torch.Tensor, response_mask_BR: torch.Tensor,
                           *, temperature: float = 1.0, return_entropy: EntropyMode = False,
                           chunk_size: int | None = None, fused_chunk: int | None = None,
                           host: HostRows | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """As `sequence_logprobs` (chunk_size likewise bounds the head's logits), through `decoder`. With
    `fused_chunk`, the head, log-softmax and entropy of the real response tokens run in the fused pass of
    algo/fused_logprobs.py instead (no [tokens, vocab] tensor kept; chunk_size is then unused). host: CPU copies
    of the four tensors, which the checks and index computations read instead (`_row_and_mask` says why)."""
    if temperature <= 0:
        raise ValueError(f"padded_native_logprobs: temperature must be > 0, got {temperature}")
    check_head_only(model, "actor.forward=native")
    mask_BR = response_mask_BR.to(torch.float32)
    if responses_BR.shape[1] == 0:
        return torch.zeros_like(mask_BR), (torch.zeros_like(mask_BR) if return_entropy else None)
    # The checks and the width read the host copies when given: on device tensors each is a wait for the GPU.
    rows = host if host is not None else HostRows(prompts_BP, prompt_mask_BP, responses_BR, response_mask_BR)
    prompt_mask, response_mask = rows.prompt_mask_BP, rows.response_mask_BR
    if not bool(prompt_mask.bool().any(1).all()):
        raise ValueError("actor.forward=native: every sample needs at least one prompt token (e.g. BOS) to "
                         "condition its first response token on; a row of prompt_mask is all 0")
    real = int((prompt_mask.sum(1) + response_mask.sum(1)).max())
    decoder.check_lengths(real)
    ids_BW, pred_BR = compact_rows(prompts_BP, prompt_mask_BP, responses_BR, response_mask_BR, bucket_length(real))
    positions_BW = torch.arange(ids_BW.shape[1], device=ids_BW.device).expand_as(ids_BW)
    hidden_BWD = decoder.hidden(model, ids_BW, positions_BW)
    head = _lm_head(model)
    if fused_chunk is not None and getattr(head, "bias", None) is None:
        # Only the real response tokens' hidden states, as in the packed path: [M, D] rows of the flattened batch.
        index_M = upload(torch.nonzero(response_mask.flatten()).flatten(), ids_BW.device)
        rows_BR = torch.arange(ids_BW.shape[0], device=ids_BW.device)[:, None] * ids_BW.shape[1] + pred_BR
        hidden_MD = hidden_BWD.flatten(0, 1).index_select(0, rows_BR.flatten()[index_M])
        logp_M, ent_M = fused_logprobs_entropy(hidden_MD, head.weight, responses_BR.flatten()[index_M],
                                               temperature=temperature, chunk=fused_chunk,
                                               return_entropy=bool(return_entropy))
        keep_BR = response_mask_BR.bool()
        return (unpack_tokens(logp_M, keep_BR, index_M),
                unpack_tokens(ent_M, keep_BR, index_M) if return_entropy else None)
    hidden_BRD = hidden_BWD.gather(1, pred_BR[..., None].expand(-1, -1, hidden_BWD.shape[-1]))
    logp_BR, ent_BR = head_stats(hidden_BRD, responses_BR, head, temperature, return_entropy, chunk_size)
    return logp_BR * mask_BR, (ent_BR * mask_BR if return_entropy else None)


def packed_native_logprobs(decoder: NativeDecoder, model: nn.Module, prompts_BP: torch.Tensor,
                           prompt_mask_BP: torch.Tensor, responses_BR: torch.Tensor, response_mask_BR: torch.Tensor,
                           *, temperature: float = 1.0, return_entropy: EntropyMode = False,
                           fused_chunk: int | None = None, attention: str = "dense", align: int = PACK_ALIGN,
                           share_prompts: bool = False, max_segment: int = 0,
                           host: HostRows | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """As `packed_logprobs`, through `decoder`; attention: how the row's samples are kept apart (`packed_mask`:
    dense, flex, varlen or segments; max_segment: the varlen kernel's length bound, models/varlen.py).
    share_prompts: consecutive samples with one prompt run it once (`pack`). host: CPU copies of the four
    tensors, which the row is built from (`_row_and_mask`)."""
    if temperature <= 0:
        raise ValueError(f"packed_native_logprobs: temperature must be > 0, got {temperature}")
    check_head_only(model, "actor.forward=native")
    rows = host if host is not None else HostRows(prompts_BP, prompt_mask_BP, responses_BR, response_mask_BR)
    if decoder.spec.attention_window is not None:  # a host read only for a windowed model (Mistral)
        decoder.check_lengths(int((rows.prompt_mask_BP.sum(1) + rows.response_mask_BR.sum(1)).max()))
    # The bound covers a pad doc too (up to PACK_ALIGN tokens, `pack`), or short configs would see two bounds.
    pk, mask = _row_and_mask(rows, prompts_BP.device, attention, max(max_segment, PACK_ALIGN), align, share_prompts)
    hidden_1ND = decoder.hidden(model, pk.input_ids_1N, pk.position_ids_1N, mask)
    return packed_head_stats(model, hidden_1ND[0], pk, temperature=temperature, return_entropy=return_entropy,
                             fused_chunk=fused_chunk)


def _row_and_mask(rows: HostRows, device: torch.device, attention: str, floor: int, align: int,
                  share_prompts: bool) -> tuple[Packed, Mask]:
    """The packed row of `rows` and its attention mask (`packed_mask`), on `device`. From host rows, the row and
    varlen segments are built on the host and queued (`Packed.to`). Why: built on the GPU they take ~20 host
    reads of device values (nonzero, lengths), each a wait for the GPU to drain, so no micro-batch could be
    queued ahead of it. Measured, those waits cost the long-tailed step little, as the host is busy for the whole
    update anyway (bench/RESULTS.md, "GPU speed, eleventh round"). Flex's BlockMask is built on the device from
    the queued row, with no host read either (tests/models/test_host_packing.py); the padded segments, CPU's
    kind, read lengths back."""
    pk = pack(*rows, align=align, share_prompts=share_prompts)
    if attention == "varlen":
        return pk.to(device), packed_mask(pk.doc_N, pk.seg_N, attention, floor).to(device)
    pk = pk.to(device)
    return pk, packed_mask(pk.doc_N, pk.seg_N, attention, floor)


def _mask_kind(attention: str | None) -> str:
    """The native forward's `packed_mask` kind for an actor.packed_attention choice."""
    return {"flex_attention": "flex", "varlen": "varlen", "segments": "segments"}.get(attention or "", "dense")


@dataclass(frozen=True)
class NativeForward:
    """The log-prob function of a role with `actor.forward: native`: packed when `packed` is set (its token
    budget, fused chunk and attention), else padded, with `fused_chunk` tokens of the fused head pass at a time
    when it is set, else `chunk` positions of logits at a time."""

    decoder: NativeDecoder
    packed: PackedForward | None = None
    chunk: int | None = None
    fused_chunk: int | None = None

    def __call__(self, model: nn.Module, prompts_BP: torch.Tensor, prompt_mask_BP: torch.Tensor,
                 responses_BR: torch.Tensor, response_mask_BR: torch.Tensor, *, temperature: float,
                 return_entropy: EntropyMode, host: HostRows | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """host: CPU copies of the four tensors, which the packed row (and varlen segments) are built from and
        the padded path's checks and index read, instead of device values (`_row_and_mask`)."""
        args = (self.decoder, model, prompts_BP, prompt_mask_BP, responses_BR, response_mask_BR)
        if self.packed is None:
            return padded_native_logprobs(*args, temperature=temperature, return_entropy=return_entropy,
                                          chunk_size=self.chunk, fused_chunk=self.fused_chunk, host=host)
        return packed_native_logprobs(*args, temperature=temperature, return_entropy=return_entropy,
                                      fused_chunk=self.packed.fused_chunk,
                                      attention=_mask_kind(self.packed.attention), align=self.packed.row_align,
                                      share_prompts=self.packed.share_prompts, max_segment=self.packed.max_segment,
                                      host=host)

    def token_slots(self, prompt_mask_BP: torch.Tensor, response_mask_BR: torch.Tensor,
                    prompts_BP: torch.Tensor | None = None) -> tuple[int, int]:
        """(real tokens, token slots this forward computes: the packed row, or B x the bucketed width)."""
        if self.packed is not None:
            return self.packed.token_slots(prompt_mask_BP, response_mask_BR, prompts_BP)
        lengths_B = prompt_mask_BP.sum(1) + response_mask_BR.sum(1)
        return int(lengths_B.sum()), prompt_mask_BP.shape[0] * bucket_length(int(lengths_B.max()))
