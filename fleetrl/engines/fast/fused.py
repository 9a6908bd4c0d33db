"""Fused copies of each layer's q/k/v and gate/up projections, kept by the fast engine for its decode step.

Why: the engine reads the trainer's HF modules in place, where q, k, v (and gate, up) are separate matrices. At
decode batch sizes every projection is a small, launch- and latency-bound GEMM, so reading them as one
[q + 2 kv, hidden] and one [2 I, hidden] matrix turns five GEMMs per layer into two (0.5B Qwen2.5: ~170 GEMMs
per step into ~100).

Cost: one more copy of those weights, bytes = L x [hidden x (H·d + 2·KVH·d + 2·I) + biases] x element size
(biases: H·d + 2·KVH·d per layer for Qwen2, none for Llama):
  Qwen2.5-0.5B bf16: 24 x 896 x (896 + 256 + 2·4864)   = 234.0 M parameters = 0.47 GB (0.44 GiB)
  Qwen2.5-1.5B bf16: 28 x 1536 x (1536 + 512 + 2·8960) = 858.8 M parameters = 1.72 GB (1.60 GiB)
i.e. about half the model again (Qwen2.5-0.5B: 494 M parameters, 1.5B: 1.54 B), held between calls and freed by
`FastRolloutEngine.sleep`; and one copy of those bytes (read + write) each time the weights change, ~0.2 ms /
~0.8 ms at the H200's ~4.2 TB/s copy rate.

Folded norms (`fold_norms`, the Triton decode's setting): each layer's input RMSNorm weight is multiplied into
wqkv's columns and its post-attention one into wgu's, W' = W·diag(g), since
g ⊙ (x / rms(x)) · Wᵀ = (x · W'ᵀ) / rms(x). The 1/rms(x) per row and the biases are then applied by the kernel
that reads the GEMM's output (attention, SiLU·up), so a decode layer launches no norm kernel (forward.py
`_decode_folded`). The row views handed to a prefill are folded too, and `attach` sets ln1/ln2 to None so that
every reader skips the weight. Qwen3's per-head q_norm / k_norm stay where they are (LayerWeights.qn/kn, read from
the model): they normalise each head of the projection's *output* by that head's own rms, which no scaling of W
can express, and they run after the row's 1/rms(x) and the bias are applied (the attention kernel; the torch path
after its normalised-input GEMM), so the fold stays exact up to rounding for them too.

Invariant: the copies equal the model's tensors (folded, with fold_norms) whenever a decode runs. The engine
marks them stale wherever it learns the weights changed (`weights_version` assigned — the trainer's colocated
sync and `load_weights` both do — a parameter re-allocated, a LoRA merge) and `refresh` copies in place, so a
captured CUDA graph keeps reading the same addresses.
"""
from __future__ import annotations

import dataclasses

import torch

from fleetrl.engines.fast.arch import DecoderSpec, LayerWeights, ModelWeights


def fused_nbytes(spec: DecoderSpec, intermediate: int, element_size: int, qkv_bias: bool) -> int:
    """Bytes of the fused copies (the formula in the module docstring; Qwen2's q/k/v biases included)."""
    qkv = spec.num_heads * spec.head_dim + 2 * spec.num_kv_heads * spec.head_dim
    per_layer = (qkv + 2 * intermediate) * spec.hidden + (qkv if qkv_bias else 0)
    return spec.num_layers * per_layer * element_size


class FusedProjections:
    """wqkv [q + 2 kv, hidden], wgu [2 I, hidden] (and their biases, zero where a part has none) per layer."""

    def __init__(self, fold_norms: bool = False) -> None:
        self._layers: list[dict[str, torch.Tensor | None] | None] | None = None
        self.stale = True
        self.fold_norms = fold_norms

    def release(self) -> None:
        """Frees the buffers; the next `refresh` allocates new ones (captured graphs must be dropped too)."""
        self._layers, self.stale = None, True

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self._layers or [] for t in (layer or {}).values()
                   if t is not None)

    def refresh(self, weights: ModelWeights, dtype: torch.dtype | None = None) -> None:
        """Copies the current projections into the fused buffers (allocated on first use, in `dtype` or the
        weights' own), in place so their addresses stay fixed."""
        for i, lw in enumerate(weights.layers):
            self.refresh_layer(i, lw, len(weights.layers), dtype)
        self.stale = False

    def refresh_layer(self, i: int, lw: LayerWeights, num_layers: int, dtype: torch.dtype | None = None) -> None:
        """`refresh` of decoder layer i alone (its buffers allocated on first use): the engine's own copy fills
        the layers one at a time, each gathered from an FSDP2-sharded model only while it is copied (owned.py)."""
        if self._layers is None:
            self._layers = [None] * num_layers
        fused = self._layers[i]
        if fused is None:
            fused = self._layers[i] = _allocate(lw, dtype or lw.wq.dtype)
        # the model's own (or merged) weights, never attached ones: those have the norms folded in already
        assert not self.fold_norms or (lw.ln1 is not None and lw.ln2 is not None), "refresh from raw weights"
        qkv, gu = (lw.wq, lw.wk, lw.wv), (lw.wg, lw.wu)
        _copy_rows(fused["wqkv"], qkv, qkv, lw.ln1 if self.fold_norms else None)
        _copy_rows(fused["wgu"], gu, gu, lw.ln2 if self.fold_norms else None)
        if fused["bqkv"] is not None:
            _copy_rows(fused["bqkv"], (lw.bq, lw.bk, lw.bv), qkv)
        if fused["bgu"] is not None:
            _copy_rows(fused["bgu"], (lw.bg, lw.bu), gu)

    def attach(self, weights: ModelWeights) -> ModelWeights:
        """`weights` with each layer's wqkv/wgu set and wq/wk/wv/wg/wu (and biases) replaced by row views of
        them: the decode reads the fused matrices, a prefill the views, both the same memory. With fold_norms,
        ln1 and ln2 are None: their weights are in those matrices."""
        assert self._layers is not None and not self.stale, "fused projections used before refresh"
        layers = [_views(lw, f) for lw, f in zip(weights.layers, self._layers)]
        if self.fold_norms:
            layers = [dataclasses.replace(lw, ln1=None, ln2=None) for lw in layers]
        return dataclasses.replace(weights, layers=layers)


def _allocate(lw: LayerWeights, dtype: torch.dtype) -> dict[str, torch.Tensor | None]:
    def rows(parts: tuple[torch.Tensor, ...], *width: int) -> torch.Tensor:
        return torch.empty(sum(p.shape[0] for p in parts), *width, dtype=dtype, device=lw.wq.device)

    qkv, gu = (lw.wq, lw.wk, lw.wv), (lw.wg, lw.wu)
    has_bqkv = any(b is not None for b in (lw.bq, lw.bk, lw.bv))
    has_bgu = any(b is not None for b in (lw.bg, lw.bu))
    return {"wqkv": rows(qkv, lw.wq.shape[1]), "wgu": rows(gu, lw.wg.shape[1]),
            "bqkv": rows(qkv) if has_bqkv else None, "bgu": rows(gu) if has_bgu else None}


def _copy_rows(dst: torch.Tensor, parts: tuple[torch.Tensor | None, ...], weights: tuple[torch.Tensor, ...],
               columns: torch.Tensor | None = None) -> None:
    """dst = cat(parts) along dim 0, in place (casting to dst's dtype); part i spans weights[i]'s rows. A missing
    part (a projection without bias beside one with) is zeros: adding 0.0 is exact. `columns`: multiply column j
    by columns[j], in the promoted dtype of the two (fp32 in, fp32 product) and rounded to dst's dtype once."""
    start = 0
    for part, w in zip(parts, weights):
        n = w.shape[0]
        if part is None:
            dst[start: start + n].zero_()
        elif columns is None:
            dst[start: start + n].copy_(part)
        else:
            torch.mul(part, columns, out=dst[start: start + n])
        start += n


def _views(lw: LayerWeights, fused: dict[str, torch.Tensor | None]) -> LayerWeights:
    wqkv, wgu, bqkv, bgu = fused["wqkv"], fused["wgu"], fused["bqkv"], fused["bgu"]
    nq, nk, ni = lw.wq.shape[0], lw.wk.shape[0], lw.wg.shape[0]
    wq, wk, wv = wqkv.split((nq, nk, nk))
    wg, wu = wgu.split((ni, ni))
    bq, bk, bv = bqkv.split((nq, nk, nk)) if bqkv is not None else (None, None, None)
    bg, bu = bgu.split((ni, ni)) if bgu is not None else (None, None)
    return dataclasses.replace(lw, wq=wq, bq=bq, wk=wk, bk=bk, wv=wv, bv=bv, wg=wg, bg=bg, wu=wu, bu=bu,
                               wqkv=wqkv, bqkv=bqkv, wgu=wgu, bgu=bgu)
