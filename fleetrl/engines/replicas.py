"""Every data-parallel rank starts from the same weights: built alike where it can be shown, shipped where not.

A model the loader built (models/hf.py `load_causal_lm`: the same file, or the same seeded draw of
models/meta_init.py) is the same on every rank by construction, so its weights are not broadcast: the ranks compare
a fingerprint (sum and sum of squares, in float64, of a few whole matrices; one all-gather of a few numbers), and a
divergence — another checkpoint revision on one node, another transformers version — stops the build with a message
instead of training different models. What is drawn after loading from a worker's rank-seeded generator (LoRA's A
matrices), and every trainable weight of a model the loader did not mark, still travels from rank 0, as DDP does.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from fleetrl.errors import UserError
from fleetrl.models.lora import lora_layers
from fleetrl.models.meta_init import FINGERPRINT_PER_GROUP, built_alike, fingerprint, is_deferred

_SLOTS = 2 * FINGERPRINT_PER_GROUP  # fingerprinted tensors, at most
_RTOL = 1e-6  # float64 sums of equal tensors agree to ~1e-13 whatever the summation order; a different draw by ~1e-3


class WeightsDivergeError(UserError, RuntimeError):
    """The ranks of one training group built different weights from what should be the same model."""


def unshared(model: nn.Module) -> list[nn.Parameter]:
    """The trainable parameters ranks may hold differently, to broadcast from rank 0: all of them, unless the loader
    built the model alike on every rank; then only the LoRA adapters added since."""
    if not built_alike(model):
        return [p for p in model.parameters() if p.requires_grad]
    return [p for layer in lora_layers(model).values() for name, p in layer.named_parameters()
            if name.startswith("lora_") and p.requires_grad]


def check_alike(model: nn.Module, group: object | None, what: str = "model") -> None:
    """For a model built alike (and already on its device): raises WeightsDivergeError unless every rank of `group`
    holds the same fingerprint. A model still on the meta device is checked by whoever materialises it."""
    if built_alike(model) and not is_deferred(model):
        check_same(fingerprint(model), group, what)


def check_same(stats: dict[str, torch.Tensor], group: object | None, what: str = "model") -> None:
    """Compares `stats` (models/meta_init.py `fingerprint`, from every rank in the same order) across `group`;
    raises WeightsDivergeError naming the first rank and tensor that differ from rank 0's."""
    names = list(stats)
    assert len(names) <= _SLOTS, names
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    mine = torch.zeros(1 + 2 * _SLOTS, dtype=torch.float64, device=device or "cpu")
    mine[0] = len(names)
    if names:
        mine[1:1 + 2 * len(names)] = torch.cat([stats[n].reshape(2).to(mine.device) for n in names])
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    ref = everyone[0].cpu()
    for rank, theirs in enumerate(t.cpu() for t in everyone):
        same = torch.isclose(theirs, ref, rtol=_RTOL, atol=1e-12)
        if bool(same.all()):
            continue
        bad = int((~same).nonzero()[0])
        if bad == 0:
            detail = f"fingerprints {int(theirs[0])} tensors, rank 0's {int(ref[0])}"
        else:
            i, which = divmod(bad - 1, 2)
            label = names[i] if i < len(names) else f"tensor #{i}"
            kind = ("sum", "sum of squares")[which]
            detail = f"has {label} with {kind} {float(theirs[bad]):.9g}, rank 0 {float(ref[bad]):.9g}"
        raise WeightsDivergeError(
            f"{what} weights differ between ranks: rank {rank} {detail}. Every rank builds its own weights instead of "
            "receiving rank 0's (docs/architecture.md, Start-up), so every node must see the same model.path (the "
            "same files and revision; a random: shape draws the same seed) with the same fleetrl, torch and "
            "transformers versions")
