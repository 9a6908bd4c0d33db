"""A copy of the model's weights in the engine's compute dtype at fixed addresses (fp32 master weights, bf16 decode
under CUDA graphs).

Why: a CUDA graph reads the addresses it was captured with. The copy the engine casts at the start of each call on
CPU (`DecoderForward.cast_for_call`) is new memory every time, so a graph captured on it would read freed memory
at the next call. This one is allocated once and refreshed in place (`copy_`, casting) where the engine learns the
weights changed, exactly as the fused q/k/v and gate/up copies are (fused.py), so the graphs stay valid.

What it holds: every tensor of the weights handed to `refresh` that is not already in the compute dtype. The fused
buffers are allocated in that dtype and a LoRA merge is rounded to it (`merged_weights(dtype=...)`), both at fixed
addresses of their own, so they are read as they are and never copied twice. A tied embedding / LM head is one
buffer. Cost: 2 bytes (bf16) x those parameters, held between calls and freed by `FastRolloutEngine.sleep`, and
one cast-copy of them (read + write) each time the weights change. SmolLM2-135M in bf16: 0.27 GB for the whole
model; 0.13 GB beside the fused projections (CUDA's default: q/k/v and gate/up are 70 M of its 135 M parameters);
57 MB, the tied embedding and the norms, with the LoRA example's adapters on every linear layer (measured on an
H100), whose merges are bf16 already.

Invariant: while `stale` is False the buffers equal the model's current weights rounded to the compute dtype.
"""
from __future__ import annotations

import torch

from fleetrl.engines.fast.arch import LayerWeights, ModelWeights


class CastCopy:
    """The compute-dtype buffers of one engine; `refresh` returns the weights to decode with."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.stale = True
        self._buffers: dict[int, torch.Tensor] | None = None  # slot index (`_slots`) -> its buffer

    def release(self) -> None:
        """Frees the buffers; the next `refresh` allocates new ones (captured graphs must be dropped too)."""
        self._buffers, self.stale = None, True

    def nbytes(self) -> int:
        unique = {b.data_ptr(): b for b in (self._buffers or {}).values()}
        return sum(b.numel() * b.element_size() for b in unique.values())

    def refresh(self, weights: ModelWeights) -> ModelWeights:
        """`weights` in the compute dtype: a tensor already in it is used as it is; every other one is read from its
        buffer, allocated on first use and copied into, in place, when the copy is stale."""
        slots = _slots(weights)
        if self._buffers is None:
            self._buffers, self.stale = self._allocate(slots), True
        # The same slots need a cast at every call (the model's dtype and the fused/merged layout are fixed for an
        # engine); a change would mean a buffer left behind or a tensor read in the wrong dtype.
        assert set(self._buffers) == {i for i, t in enumerate(slots) if t is not None and t.dtype != self.dtype}, \
            "the weights' layout changed since the cast copy was allocated"
        if self.stale:
            done: set[int] = set()
            for i, buf in self._buffers.items():
                if buf.data_ptr() not in done:  # a tied embedding / LM head: copied once
                    buf.copy_(slots[i])
                    done.add(buf.data_ptr())
            self.stale = False
        return _from_slots(weights, [self._buffers.get(i, t) for i, t in enumerate(slots)])

    def _allocate(self, slots: list[torch.Tensor | None]) -> dict[int, torch.Tensor]:
        buffers: dict[int, torch.Tensor] = {}
        by_source: dict[tuple, torch.Tensor] = {}
        for i, t in enumerate(slots):
            if t is None or t.dtype == self.dtype:
                continue
            key = (t.data_ptr(), tuple(t.shape), t.stride())  # a tied LM head is the embedding's memory
            if key not in by_source:
                by_source[key] = torch.empty(t.shape, dtype=self.dtype, device=t.device)
            buffers[i] = by_source[key]
        return buffers


def _slots(w: ModelWeights) -> list[torch.Tensor | None]:
    """Every tensor field of `w` in a fixed order: embed, norm, lm_head, then each layer's LayerWeights fields."""
    out: list[torch.Tensor | None] = [w.embed, w.norm, w.lm_head]
    for lw in w.layers:
        out.extend(getattr(lw, f) for f in LayerWeights.__slots__)
    return out


def _from_slots(w: ModelWeights, slots: list[torch.Tensor | None]) -> ModelWeights:
    n = len(LayerWeights.__slots__)
    layers = [LayerWeights(*slots[3 + i * n: 3 + (i + 1) * n]) for i in range(len(w.layers))]
    return ModelWeights(slots[0], layers, slots[1], slots[2])
