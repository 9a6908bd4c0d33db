"""The fast engine's own copy of every weight it decodes with, filled one decoder layer at a time (`own_weights`).

Why: by default the engine decodes with the model's tensors in place (or views of them under tensor parallelism,
tp.py), so with an FSDP2-sharded colocated actor the rollout gathered the whole model on every rank for the whole
call (workers/rollout.py `unsharded`), of which a TP rank reads 1/k. Qwen2.5-72B in bf16 is 145 GB: no 141 GB
card holds it beside anything. Here each rank keeps

  * its slices of the projections (q/k/v, gate/up: row slices; o, down: column slices; tp.py), fused where the
    engine fuses (fused.py), and
  * the embedding, the norms and the LM head whole (one buffer when tied),

all in the compute dtype at fixed addresses (captured CUDA graphs read them), and fills them from the model one
decoder layer at a time: an FSDP2 layer is gathered (`unshard`) only while its slices are copied, then resharded,
so the transient is one layer's whole weights. A LoRA actor's adapters are merged on the whole layer first, then
sliced, as at k = 1.

Cost per rank: 1/k of the projections plus the embedding and head, in the compute dtype (Qwen2.5-72B, TP 4, bf16:
~35 GB of projections + 2 x 2.5 GB), held between calls and freed by `FastRolloutEngine.sleep`; per weights
version one read of the whole layers (the same all-gather traffic as a whole-model unshard) and one write of the
rank's slices. A LoRA actor's merge is refreshed with the version too (not at every call, as the fused copies are):
its adapters change only at an update, which bumps the version.

Invariant: while `stale` is False, `weights` equals the model's current (merged) weights, sliced for this rank and
rounded to the compute dtype.
"""
from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from typing import Iterator

import torch

from fleetrl.engines.fast.arch import (
    LayerWeights,
    ModelWeights,
    check_adapted,
    layer_weights,
    merged_head,
    merged_layer,
)
from fleetrl.engines.fast.fused import FusedProjections
from fleetrl.engines.fast.tp import TensorParallel, shard_layer

FUSED_FIELDS = ("wq", "bq", "wk", "bk", "wv", "bv", "wg", "bg", "wu", "bu")  # held by the fused buffers instead


@contextmanager
def gathered(module: torch.nn.Module) -> Iterator[None]:
    """`module`'s own FSDP2 parameter group whole inside the block (its sharded children stay sharded); nothing to
    do for a module FSDP2 does not manage. Collective: every rank of the FSDP2 group enters it together."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        yield
        return
    module.unshard()
    try:
        yield
    finally:
        module.reshard()


class OwnedWeights:
    """The engine's copy (module docstring); `refresh(model)` returns the weights to decode with."""

    def __init__(self, dtype: torch.dtype, tp: TensorParallel | None, fused: FusedProjections | None) -> None:
        self.dtype, self.tp, self.fused = dtype, tp, fused
        self.stale = True
        self._own: ModelWeights | None = None  # this copy's tensors (fused fields as shapes only)
        self.weights: ModelWeights | None = None  # what the engine decodes with: _own with the fused buffers attached

    def release(self) -> None:
        """Frees the copy (and the fused buffers); the next `refresh` allocates it again."""
        self.weights, self._own, self.stale = None, None, True
        if self.fused is not None:
            self.fused.release()

    def nbytes(self) -> int:
        tensors = [] if self._own is None else self._own.tensors()
        unique = {t.data_ptr(): t for t in tensors if t.device.type != "meta"}
        return sum(t.numel() * t.element_size() for t in unique.values()) + (self.fused.nbytes() if self.fused else 0)

    @torch.no_grad()
    def refresh(self, model: torch.nn.Module) -> ModelWeights:
        """Brings the copy up to the model's current weights where stale, gathering one FSDP2 group at a time; returns
        what the engine decodes with. Only where stale: a LoRA actor's adapters change with the weights version (the
        colocated sync bumps it after each update), and under FSDP2 every refresh is a collective, so the ranks must
        refresh at the same calls whatever each one's number of calls (a multi-turn episode's turns differ)."""
        from fleetrl.models.lora import lora_layers

        if self.weights is not None and not self.stale:
            return self.weights
        adapted = lora_layers(model)
        layers = list(model.model.layers)
        check_adapted(adapted, len(layers))
        old = self._own
        with gathered(model):  # the root's own group: the embedding, the final norm, the LM head
            embed = self._copy(model.model.embed_tokens.weight.data, old and old.embed)
            norm = self._copy(model.model.norm.weight.data, old and old.norm)
            tied = model.lm_head.weight is model.model.embed_tokens.weight
            head = embed if tied else self._copy(merged_head(model.lm_head.weight.data, adapted), old and old.lm_head)
        own = []
        for i, layer in enumerate(layers):
            with gathered(layer):
                lw = merged_layer(layer_weights(layer), i, adapted)
                if self.tp is not None:
                    lw = shard_layer(lw, self.tp.rank, self.tp.size)
                if self.fused is not None:
                    self.fused.refresh_layer(i, lw, len(layers), self.dtype)
                own.append(self._copy_layer(lw, old and old.layers[i]))
        self._own = ModelWeights(embed, own, norm, head)
        if self.fused is not None:
            self.fused.stale = False
        self.weights = self._own if self.fused is None else self.fused.attach(self._own)
        self.stale = False
        return self.weights

    def _copy(self, src: torch.Tensor, into: torch.Tensor | None) -> torch.Tensor:
        """src in the compute dtype, written into `into` (allocated when None: the first refresh)."""
        into = torch.empty(src.shape, dtype=self.dtype, device=src.device) if into is None else into
        return into.copy_(src)

    def _copy_layer(self, lw: LayerWeights, into: LayerWeights | None) -> LayerWeights:
        """The layer's tensors the engine reads from this copy; those the fused buffers hold are shapes only (meta
        tensors: `FusedProjections.attach` replaces them with row views of its buffers)."""
        fields = {}
        for f in LayerWeights.__slots__:
            t = getattr(lw, f)
            if t is None or f in ("wqkv", "bqkv", "wgu", "bgu"):
                fields[f] = None
            elif self.fused is not None and f in FUSED_FIELDS:
                fields[f] = torch.empty(t.shape, dtype=self.dtype, device="meta")
            else:
                fields[f] = self._copy(t, None if into is None else getattr(into, f))
        return dataclasses.replace(lw, **fields)
