"""Device-resident state of the fast engine: the static KV cache and the per-slot decode buffers.

Everything a decode step reads or writes lives here at a fixed address, so one captured CUDA graph per batch
bucket can be replayed for the whole call (and the next ones) with no host-side tensor creation.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fleetrl.batch import upload
from fleetrl.engines.fast.arch import DecoderSpec

MAX_STOP_IDS = 32  # EOS ids + SamplingParams.stop_token_ids, padded with -1 (never a token id)


@dataclass(slots=True)
class SlotBuffers:
    """Static buffers for `slots` concurrent sequences of up to `max_seq_len` tokens (prompt + response).

    k, v        [layers, slots, kv_heads, max_seq_len, head_dim]  model dtype
    tokens      [slots] long   last sampled token, fed to the next decode step
    pos         [slots] long   position of `tokens` (= tokens already in the cache for that slot)
    done        [slots] bool   finished (or free); a done slot computes garbage that nobody reads
    count       [slots] long   response tokens sampled so far
    limit       [slots] long   max_new_tokens of the request in the slot
    req         [slots] long   request index (keys the random stream, so samples don't depend on the slot)
    lead        [slots] long   slot whose cache rows [0, shared) equal this slot's: the leader of its prompt's
                               group, whose rows the prefill copied here; the Triton decode reads them there
    shared      [slots] long   see lead; 0 = own rows only. A slot that stops or moves first points every slot
                               that leads from it back to itself (`release`): its rows may be overwritten next
    out_tok     [slots, max_seq_len + 1] long    response tokens; the last column is a junk sink for done slots
    out_lp      [slots, max_seq_len + 1] float32 logprob of each sampled token
    stop_ids    [MAX_STOP_IDS] long; seed [1] long; temperature [1] float32
    """

    k: torch.Tensor
    v: torch.Tensor
    tokens: torch.Tensor
    pos: torch.Tensor
    done: torch.Tensor
    count: torch.Tensor
    limit: torch.Tensor
    req: torch.Tensor
    lead: torch.Tensor
    shared: torch.Tensor
    out_tok: torch.Tensor
    out_lp: torch.Tensor
    stop_ids: torch.Tensor
    seed: torch.Tensor
    temperature: torch.Tensor

    @classmethod
    def allocate(cls, spec: DecoderSpec, slots: int, max_seq_len: int, dtype: torch.dtype,
                 device: torch.device) -> "SlotBuffers":
        kv_shape = (spec.num_layers, slots, spec.num_kv_heads, max_seq_len, spec.head_dim)
        long = dict(dtype=torch.long, device=device)
        return cls(
            k=torch.zeros(kv_shape, dtype=dtype, device=device), v=torch.zeros(kv_shape, dtype=dtype, device=device),
            tokens=torch.zeros(slots, **long), pos=torch.zeros(slots, **long),
            done=torch.ones(slots, dtype=torch.bool, device=device), count=torch.zeros(slots, **long),
            limit=torch.ones(slots, **long), req=torch.zeros(slots, **long),
            lead=torch.arange(slots, **long), shared=torch.zeros(slots, **long),
            out_tok=torch.zeros(slots, max_seq_len + 1, **long),
            out_lp=torch.zeros(slots, max_seq_len + 1, dtype=torch.float32, device=device),
            stop_ids=torch.full((MAX_STOP_IDS,), -1, **long), seed=torch.zeros(1, **long),
            temperature=torch.ones(1, dtype=torch.float32, device=device))

    @property
    def slots(self) -> int:
        return self.k.shape[1]

    @property
    def seq_len(self) -> int:
        return self.k.shape[3]

    @property
    def junk_col(self) -> int:
        return self.out_tok.shape[1] - 1

    def release(self, index: torch.Tensor) -> None:
        """The slots in `index` (long, on the buffers' device: `device_index`) stop or move: every slot reading
        prefix rows there reads its own copy from now on."""
        # A mask over the slots, read at each slot's leader. Not torch.isin: from ~22 values it sorts, and its
        # unique copies a count to the host, which would wait for the decode steps queued to overlap this work.
        # Nor `released[index] = True`: that copies the scalar up from pageable memory, which waits too (both
        # measured on an H200, bench/RESULTS.md tenth round). index_fill_ takes the value as a kernel argument.
        released = torch.zeros(self.slots, dtype=torch.bool, device=self.lead.device)
        released.index_fill_(0, index, True)
        gone = released[self.lead]
        self.lead.copy_(torch.where(gone, torch.arange(self.slots, device=self.lead.device), self.lead))
        self.shared.masked_fill_(gone, 0)

    def step_state(self) -> list[torch.Tensor]:
        """The buffers a decode step changes besides the cache rows it rewrites (saved around graph warm-up)."""
        return [self.tokens, self.pos, self.done, self.count]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.out_tok, self.out_lp))


def device_index(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """values as a long tensor on `device`, through `upload` (fleetrl/batch.py)."""
    return upload(torch.tensor(list(values), dtype=torch.long), device)
