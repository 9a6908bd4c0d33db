"""Models built on the meta device and materialised where they will live, the same on every rank without a broadcast.

Why: a 7B shape built eagerly on the host took minutes on one thread and 15-30 GB of host memory per worker, was
copied whole to its GPU, broadcast from rank 0 and only then cut to a quarter by FSDP2. Built on the meta device a
model costs nothing until `materialize` allocates it on its device — after sharding, only this rank's shard — and
draws its values there from a seeded generator.

Invariant: the values depend only on (seed, model class and config, device type, dtype), never on the world size
or the rank. Each parameter is drawn whole, in module order, from one generator seeded once; a sharded rank keeps
its slice of the whole draw. So every rank builds the same weights without receiving any, an unsharded reference
model equals the sharded actor it is compared with (KL 0 at step 1), and ranks confirm it by comparing a
`fingerprint` of a few whole tensors (engines/replicas.py). CPU and CUDA generators draw different streams: the
same seed gives different (equally distributed) weights on a CPU and on a GPU.

Initialisation follows transformers' `_init_weights` for decoder LMs: linear and embedding weights N(0, std) with
std = config.initializer_range, biases 0, norm weights 1; non-persistent buffers (rotary inverse frequencies) are
recomputed by building their module again on the host.
"""
from __future__ import annotations

import math
from typing import Callable, Iterator

import torch
from torch import nn

_SEED = "_fleetrl_meta_seed"  # on a model still on the meta device: the seed `materialize` will draw it with
_ALIKE = "_fleetrl_built_alike"  # on a model every rank built identically (loaded from one file or seeded)
FINGERPRINT_PER_GROUP = 2  # the smallest matrices fingerprinted, of the trainable and of the frozen ones each


def build_on_meta(factory: Callable[[], nn.Module], seed: int) -> nn.Module:
    """`factory()` run on the meta device (no memory, no initialisation), marked to be drawn with `seed`."""
    with torch.device("meta"):
        model = factory()
    setattr(model, _SEED, seed)
    mark_built_alike(model)
    return model


def is_deferred(model: nn.Module) -> bool:
    """The model is still on the meta device, waiting for `materialize`."""
    return _SEED in model.__dict__


def mark_built_alike(model: nn.Module) -> nn.Module:
    """Records that every rank builds this model's weights identically (the same file, or the same seeded draw), so
    they need no broadcast, only a check (engines/replicas.py)."""
    setattr(model, _ALIKE, True)
    return model


def built_alike(model: nn.Module) -> bool:
    return bool(model.__dict__.get(_ALIKE, False))


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device | str) -> dict[str, torch.Tensor]:
    """Allocates a `build_on_meta` model on `device` (each FSDP2 rank only its shard, when sharded since) and draws
    its weights there. Returns the `fingerprint` statistics of the whole tensors drawn, for the ranks to compare."""
    if not is_deferred(model):
        raise ValueError(f"{type(model).__name__} is not a model built on the meta device (build_on_meta)")
    seed = model.__dict__.pop(_SEED)
    device = torch.device(device)
    _to_empty(model, device)
    generator = torch.Generator(device=device).manual_seed(seed)
    # LoRA adapters (injected on the meta device) from a stream of their own: the base draws exactly what the plain
    # shape's model draws, with or without adapters between its layers.
    adapters = torch.Generator(device=device).manual_seed(seed + 1)
    config = getattr(model, "config", None)
    std = getattr(config, "initializer_range", None) or 0.02
    watched = set(fingerprint_names(model))
    # A LoRA actor's frozen base may have been narrowed on the meta device (store_frozen_base): it is drawn in the
    # model's own dtype and rounded, as the eagerly built model it must equal is (a CPU's bf16 normal_ is another
    # draw, not the fp32 one rounded).
    built = _widest_float(model)
    stats: dict[str, torch.Tensor] = {}
    for name, module, attr, param in _own_parameters(model):
        sharded = hasattr(param, "to_local")  # an FSDP2 shard: this rank keeps its slice of the whole draw
        whole = torch.empty(param.shape, dtype=param.dtype, device=device) if sharded else param.data
        if not _draw_adapter(name, whole, adapters):
            narrowed = whole.is_floating_point() and built is not None and whole.dtype != built
            drawn = torch.empty(whole.shape, dtype=built, device=device) if narrowed else whole
            _draw(module, attr, drawn, generator, std)
            if narrowed:
                whole.copy_(drawn)
        if name in watched:
            stats[name] = tensor_stats(whole)
        if sharded:
            from torch.distributed.tensor import distribute_tensor

            param.to_local().copy_(distribute_tensor(whole, param.device_mesh, param.placements,
                                                     src_data_rank=None).to_local())
    _rebuild_buffers(model)
    return {n: stats[n] for n in fingerprint_names(model)}


def _widest_float(model: nn.Module) -> torch.dtype | None:
    """The widest floating dtype of the model's parameters: the dtype it was built in (only narrowing happens
    between the build and the draw)."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    return max(dtypes, key=lambda d: torch.finfo(d).bits, default=None)


def _to_empty(model: nn.Module, device: torch.device) -> None:
    """`to_empty` keeping every parameter object (swapped in place): a tied weight stays tied, and an optimiser made
    over the meta parameters holds the allocated ones. Without the swap, nn.Module makes a new Parameter per module
    when the device type changes (meta -> cpu/cuda), untying Qwen2.5-0.5B's LM head from its embedding."""
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)


def _own_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, torch.Tensor]]:
    """(full name, owning module, attribute, parameter) in `named_parameters` order, a tied parameter once."""
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        for attr, param in module.named_parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                yield f"{prefix}.{attr}" if prefix else attr, module, attr, param


def _draw_adapter(name: str, out: torch.Tensor, generator: torch.Generator) -> bool:
    """peft's default LoRA initialisation, where `name` is an adapter's matrix: B = 0, so the adapted model starts
    as its base; A ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)), the bound of kaiming_uniform with a = sqrt(5). False for
    any other parameter."""
    if ".lora_B." in name:
        out.zero_()
    elif ".lora_A." in name:
        bound = 1.0 / math.sqrt(out.shape[1])
        out.uniform_(-bound, bound, generator=generator)
    else:
        return False
    return True


def _draw(module: nn.Module, attr: str, out: torch.Tensor, generator: torch.Generator, std: float) -> None:
    kind = type(module).__name__
    if isinstance(module, (nn.Linear, nn.Embedding)) and attr == "weight":
        out.normal_(0.0, std, generator=generator)
        if isinstance(module, nn.Embedding) and module.padding_idx is not None:
            out[module.padding_idx].zero_()
    elif attr == "bias":
        out.zero_()
    elif attr == "weight" and ("Norm" in kind):  # RMSNorm / LayerNorm of any model family
        out.fill_(1.0)
    else:
        raise ValueError(f"materialize has no initialisation for {kind}.{attr}; add a rule to "
                         "fleetrl/models/meta_init.py `_draw` (transformers' `_init_weights` of the model says which)")


def _rebuild_buffers(model: nn.Module) -> None:
    """Buffers are computed, not drawn (rotary inverse frequencies): each module holding some is built again from
    its config on the host, and its values copied in."""
    for prefix, module in model.named_modules():
        own = dict(module.named_buffers(recurse=False))
        if not own:
            continue
        config = getattr(module, "config", None)
        if config is None:
            raise ValueError(f"materialize cannot recompute the buffers {sorted(own)} of {prefix or 'the model'} "
                             f"({type(module).__name__}): the module has no config to build it again from")
        with torch.device("cpu"):
            fresh = type(module)(config=config)
        for name, buf in own.items():
            buf.copy_(getattr(fresh, name))


def fingerprint_names(model: nn.Module) -> list[str]:
    """The parameters ranks compare: the smallest matrices of the trainable and of the frozen ones (cheap to gather
    and to sum; every seeded matrix comes from one generator stream, so a different seed or file changes them)."""
    # LoRA's B matrices start at zero on every rank whatever the seed: comparing them would check nothing.
    named = [(p.numel(), i, n, p.requires_grad) for i, (n, p) in enumerate(model.named_parameters())
             if p.dim() >= 2 and ".lora_B." not in n]
    out: list[str] = []
    for trainable in (True, False):
        out += [n for _, _, n, t in sorted(named) if t == trainable][:FINGERPRINT_PER_GROUP]
    return out


def tensor_stats(t: torch.Tensor) -> torch.Tensor:
    """[sum, sum of squares] of `t` in float64, on its device."""
    x = t.detach().double()
    return torch.stack([x.sum(), x.square().sum()])


def fingerprint(model: nn.Module) -> dict[str, torch.Tensor]:
    """`tensor_stats` of each of `fingerprint_names` (whole, unsharded parameters)."""
    params = dict(model.named_parameters())
    out = {}
    for name in fingerprint_names(model):
        if hasattr(params[name], "to_local"):
            raise ValueError(f"fingerprint of {name}: a shard; compare whole tensors (before sharding, or the "
                             "statistics `materialize` returns)")
        out[name] = tensor_stats(params[name])
    return out
