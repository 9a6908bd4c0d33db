"""Running code other than `forward` inside a module's FSDP2 hooks (engines/sharding.py shards the model and gives each
sharded module the hooked entry named `_METHOD`): `gathered_call(module, fn, ...)` runs `fn` with `module`'s
parameters gathered, and their gradients reduce-scattered in backward, as `module(...)` would; on a module that was
not sharded it is a plain call. Here, in models/, because the native decoder (models/decoder.py) calls its layers
through it and models import nothing from engines.
"""
from __future__ import annotations

from typing import Callable, TypeVar

from torch import nn

T = TypeVar("T")

_METHOD = "_fleetrl_gathered_call"


def _call(_module: nn.Module, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
    return fn(*args, **kwargs)


def gathered_call(module: nn.Module, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
    """fn(*args, **kwargs) with `module`'s FSDP2 parameters gathered for it (and their gradients reduce-scattered
    in backward), as in `module(...)`; a plain call when `module` was not sharded by `shard`."""
    method = getattr(module, _METHOD, None)
    return fn(*args, **kwargs) if method is None else method(fn, *args, **kwargs)
