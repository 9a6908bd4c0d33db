"""FSDP2 sharding of a training model, and running code other than `forward` with a module's parameters gathered.

FSDP2 (`fully_shard`) gathers a module's parameters in hooks around its `forward` and registers the backward's
reduce-scatter there. Our fast forwards do not go through `forward`: the native decoder calls a compiled layer
function with the layer as an argument (models/decoder.py), and the packed, chunked and native log-prob paths
call the backbone and read the LM head's weight directly. `gathered_call(module, fn, ...)` runs `fn` inside
`module`'s own pre/post-forward hooks (torch's `register_fsdp_forward_method`), so every one of those forwards
works on a sharded model unchanged, and on an unsharded one it is a plain call.

The root (embedding, final norm, LM head) must be entered first each forward: its pre-forward hook is where
FSDP2 sets up its root state and streams, so the actor wraps its whole log-prob call (workers/actor.py) and the
decoder wraps each layer call inside it.
"""
from __future__ import annotations

from types import MethodType
from typing import Callable, Iterable, Sequence, TypeVar

import torch
import torch.distributed as dist
from torch import nn

T = TypeVar("T")

# The hooked entry each sharded module gets, and the call that uses it, live in models/gathered.py: the native
# decoder (models/) runs its layers through them and imports nothing from engines.
from fleetrl.models.gathered import _METHOD, _call, gathered_call  # noqa: E402,F401


def shard(model: nn.Module, layers: list[nn.Module]) -> bool:
    """fully_shard each decoder layer (one all-gather per layer, overlapped with the previous one's compute), then
    the root (everything else), each with a hooked `gathered_call` entry. Uses the default process group, on
    GPU (NCCL) or CPU (gloo) alike. Returns whether the gradient reduce-scatter SUMS over ranks (this torch has
    FSDP2's divide factor and sum-only switch); if not, it averages and the caller scales its loss by the world
    size."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    modules = (*layers, model)
    for module in modules:
        fully_shard(module)
        setattr(module, _METHOD, MethodType(_call, module))
        register_fsdp_forward_method(module, _METHOD)
    sums = all(hasattr(m, "set_force_sum_reduction_for_comms") for m in modules)
    for module in modules if sums else ():
        # Our losses are normalised by GLOBAL counts, so the exact gradient is the ranks' SUM. A divide factor of
        # 1 alone becomes NCCL's PREMUL_SUM(1), which gloo lacks; forcing sum-only reductions gives a plain SUM on
        # both (and NCCL's zero-copy path), and skips the division by 1.
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
    return sums


def same_count_on_every_rank(items: Iterable[T], device: torch.device, group: object | None = None,
                             split: Callable[[int], Sequence[T]] | None = None) -> list[tuple[T, bool]]:
    """(item, real) pairs, as many on every rank of `group` as the most any rank has (one all-reduce). Why: under
    FSDP2 every micro-batch's forward gathers each layer (and the synced backward reduce-scatters it), so all ranks
    must run as many; a token budget cuts each rank's rows into its own number of micro-batches
    (workers/layout.py). A rank with fewer re-cuts its rows into that many with `split(count)` (no pass wasted);
    only where it cannot (fewer rows than the count, or no `split`) it repeats its last item, flagged not real,
    which the caller runs and discards (a zero loss)."""
    items = list(items)
    count = torch.tensor([len(items)], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    most = int(count)
    if split is not None and 0 < len(items) < most:
        items = list(split(most))
    if not items and most:
        raise RuntimeError("this rank has no micro-batch while another has some: FSDP2 needs one to repeat")
    return [(x, True) for x in items] + [(items[-1], False)] * (most - len(items))
