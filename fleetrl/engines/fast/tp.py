"""Tensor parallelism of the fast engine over a torch.distributed group (gloo on CPU, NCCL on GPU).

The split is Megatron-LM's (Shoeybi et al. 2019) for one decoder layer, over k ranks:
  * column-parallel: q, k, v (rank r keeps query heads [r·H/k, (r+1)·H/k) and KV heads [r·KVH/k, (r+1)·KVH/k),
    so each rank's query heads read only its own KV heads: the GQA group is unchanged) and gate, up (intermediate
    columns [r·I/k, (r+1)·I/k)). Their biases are split the same way.
  * row-parallel: o (its input columns of the rank's heads) and down (its input columns of the rank's
    intermediate slice). Each rank's product is a partial sum over its share of the inner dimension; one
    all-reduce (SUM) per row-parallel matmul makes the whole output on every rank, and only then is the bias
    added, once.
  * replicated: the embedding, every RMSNorm (the residual stream is whole on every rank), Qwen3's per-head q/k
    norms (one weight for all heads), RoPE, the final norm and the LM head, so every rank computes the same
    logits from the same residual stream.
The KV cache holds each rank's KV heads only (`local_spec`: the engine sizes its cache by num_kv_heads / k).

Shards are views of the full model's tensors (row slices for q/k/v/gate/up, column slices for o/down: no
copy), so an in-place optimizer step or `load_weights` is seen by the next call as at k = 1, and the fused and
cast copies (fused.py, cast.py) are built from these views: each rank's copy is 1/k of the projections. A LoRA
actor's adapters are merged on the whole weight first, then sliced (`arch.merged_weights`). The views are kept
between steps and rebuilt where the engine marks its copies stale (weights_version assigned, parameters
re-allocated, a new merge).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fleetrl.config.tensor_parallel import tp_shape_problem
from fleetrl.engines.fast.arch import DecoderSpec, LayerWeights, ModelWeights


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """One engine's TP group: this process's rank in it and the degree k."""

    group: object
    rank: int
    size: int

    @classmethod
    def of(cls, group: object | None) -> "TensorParallel | None":
        """None for no group or a one-rank group (the engine then runs exactly its k = 1 code)."""
        if group is None or dist.get_world_size(group) == 1:
            return None
        return cls(group, dist.get_rank(group), dist.get_world_size(group))

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """In-place SUM over the group (capturable in a CUDA graph with NCCL); returns t."""
        dist.all_reduce(t, group=self.group)
        return t

    def broadcast_int(self, value: int, device: torch.device) -> int:
        """group rank 0's `value` on every rank."""
        t = torch.tensor([value], dtype=torch.long, device=device)
        dist.broadcast(t, dist.get_global_rank(self.group, 0), group=self.group)
        return int(t)

    def gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """t from every rank of the group, in group-rank order."""
        out = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(out, t, group=self.group)
        return out


def check_shape(spec: DecoderSpec, intermediate: int, k: int) -> None:
    problem = tp_shape_problem(k, spec.num_heads, spec.num_kv_heads, intermediate)
    if problem is not None:
        raise ValueError(f"FastRolloutEngine tensor parallelism: {problem}")


def local_spec(spec: DecoderSpec, k: int) -> DecoderSpec:
    """The shape one rank computes: its query and KV heads (hidden, head_dim and the GQA group unchanged)."""
    return dataclasses.replace(spec, num_heads=spec.num_heads // k, num_kv_heads=spec.num_kv_heads // k)


def shard_weights(w: ModelWeights, rank: int, k: int) -> ModelWeights:
    """Rank `rank`'s views of `w` (whole, unfused weights: the model's own or a LoRA merge)."""
    return dataclasses.replace(w, layers=[shard_layer(lw, rank, k) for lw in w.layers])


def _rows(t: torch.Tensor | None, rank: int, k: int) -> torch.Tensor | None:
    if t is None:
        return None
    n = t.shape[0] // k
    return t[rank * n: (rank + 1) * n]


def _cols(t: torch.Tensor, rank: int, k: int) -> torch.Tensor:
    n = t.shape[1] // k
    return t[:, rank * n: (rank + 1) * n]


def shard_layer(lw: LayerWeights, rank: int, k: int) -> LayerWeights:
    """Rank `rank`'s views of one layer's whole, unfused weights."""
    assert lw.wqkv is None and lw.wgu is None, "shard the model's own weights, then fuse (fused.py)"
    column = {f: _rows(getattr(lw, f), rank, k) for f in ("wq", "bq", "wk", "bk", "wv", "bv", "wg", "bg", "wu", "bu")}
    # Row-parallel: bo, bd stay whole; the forward adds them once, after the all-reduce.
    return dataclasses.replace(lw, **column, wo=_cols(lw.wo, rank, k), wd=_cols(lw.wd, rank, k))


def intermediate_size(w: ModelWeights) -> int:
    return w.layers[0].wg.shape[0]
