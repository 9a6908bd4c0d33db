"""LoRA adapters on the actor (Hu et al. 2021, arXiv:2106.09685), through peft.

Each adapted linear layer computes y = x·Wᵀ + (alpha/rank)·x·Aᵀ·Bᵀ with W frozen and only A [rank, in] and
B [out, rank] trained (B starts at zero, so step 0 is the base model exactly). peft injects its `lora.Linear`
modules into the HF model IN PLACE; the trainer, the log-prob code and the `hf` rollout engine keep using that
same module object (`model.model.layers[...]` paths unchanged) and so compute with the adapted weights without
a copy. The peft wrapper is kept only for its adapter switch: under `disable_adapter()` every lora.Linear
returns `base_layer(x)`, i.e. the base model bit for bit — that is the reference policy (no second model).

Where a plain weight matrix is needed (the `fast` engine's own forward, a separate rollout pool, export and
delta checkpoints) the adapter is merged: W + (alpha/rank)·B·A, computed out of place so the frozen W is never
touched (merging in place and unmerging later would drift W by rounding every step).
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import torch
from torch import nn

from fleetrl.config.schema import LoraConfig
from fleetrl.errors import UserError

if TYPE_CHECKING:
    from peft import PeftModel

ALL_LINEAR = "all-linear"
ADAPTER = "default"  # peft's adapter name; a run trains one adapter


class LoraTargetError(UserError, ValueError):
    """actor.lora.targets names modules the model does not have (or may not be adapted)."""


def resolve_targets(model: nn.Module, targets: tuple[str, ...]) -> list[str]:
    """Full names of the linear layers `targets` select, in the model's module order.

    A target matches a linear layer whose name is the target or ends with "." + target (peft's rule for a list);
    `all-linear` selects every linear layer but the LM head, which may be named explicitly unless it is tied to
    the input embedding. Raises LoraTargetError naming the targets that match
    nothing and listing the linear layer names the model has.
    """
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_names = {name for name, m in model.named_modules() if head is not None and m is head}
    chosen: set[str] = set()
    unmatched = []
    for target in targets:
        if target == ALL_LINEAR:
            hits = [n for n in linears if n not in head_names]
        else:
            hits = [n for n in linears if n == target or n.endswith("." + target)]
        if not hits:
            unmatched.append(target)
        chosen.update(hits)
    if unmatched:
        suffixes = sorted({n.rsplit(".", 1)[-1] for n in linears})
        raise LoraTargetError(f"actor.lora.targets: {unmatched} match no linear layer of the model; its linear "
                              f"layers are named {suffixes} (full names like {linears[0]!r}). Use those names, a "
                              f"dotted suffix of a full name, or {ALL_LINEAR!r}")
    if chosen & head_names and _tied_head(model):
        raise LoraTargetError(f"actor.lora.targets selects the LM head {sorted(chosen & head_names)}, which this model "
                              "ties to its input embedding (one tensor, so a merged head would change the embedding "
                              "too); leave it out of targets")
    return [n for n in linears if n in chosen]


def _tied_head(model: nn.Module) -> bool:
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and embed is not None and head.weight is embed.weight


def apply_lora(model: nn.Module, cfg: LoraConfig, *, gradient_checkpointing: bool = False) -> PeftModel:
    """Injects adapters into `model` in place and freezes everything else; returns peft's wrapper (for
    `disable_adapter()`). `model` itself stays the module to train and generate with."""
    import peft

    names = resolve_targets(model, cfg.targets)
    # Full names leave peft no matching of its own to do, so its choice is exactly ours (and a receiving rollout
    # worker's, which resolves the same names on its plain copy of the model).
    config = peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=names,
                             bias="none")
    wrapped = peft.get_peft_model(model, config, adapter_name=ADAPTER)
    if gradient_checkpointing:
        # Reentrant checkpointing drops the gradient of a block whose inputs need none (the embedding is frozen).
        model.enable_input_require_grads()
    return wrapped


def store_frozen_base(model: nn.Module, dtype: torch.dtype, *, upcast: bool = False) -> int:
    """Keeps the frozen weight of every adapted layer in `dtype`. Returns the bytes saved. Biases, norms,
    embeddings and adapters keep their dtype; a merge (`merged_weight`) returns the adapters' dtype.

    upcast=False: `dtype` is the autocast dtype of the update, which rounds the weight to it at each matmul anyway,
    so the function trained is unchanged while the weights take half the memory and no per-matmul cast is made;
    every forward must then run under autocast. upcast=True (no autocast: a CPU without native bf16): the weight
    is stored in `dtype` and widened to the activations' dtype one layer at a time (`UpcastLinear`), so the
    matmuls stay in the model's precision on a base rounded once, as a bf16 checkpoint's is."""
    saved = 0
    for layer in lora_layers(model).values():
        base = layer.get_base_layer()
        if base.weight.dtype != dtype:
            saved += base.weight.numel() * (base.weight.element_size() - torch.finfo(dtype).bits // 8)
            base.weight = nn.Parameter(base.weight.detach().to(dtype), requires_grad=False)
        if upcast and type(base) is nn.Linear:
            # The class, not the module, is swapped: the object peft, hooks and FSDP hold stays the same one.
            base.__class__ = UpcastLinear
    return saved


class _UpcastLinearFn(torch.autograd.Function):
    """y = x·W'ᵀ + b with W' = W widened to x's dtype, for a frozen narrow W. Backward saves W itself, not W':
    autograd would otherwise keep every layer's widened copy alive from the forward to the backward, which
    undoes the saving (the whole model's weights again, at their peak)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(weight)
        return torch.nn.functional.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (weight,) = ctx.saved_tensors
        return grad @ weight.to(grad.dtype), None, None  # W and b are frozen (LoRA trains the adapters only)


class UpcastLinear(nn.Linear):
    """A frozen linear layer whose weight is stored narrower than its input (store_frozen_base(upcast=True))."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype == x.dtype or torch.is_autocast_enabled(x.device.type):
            return super().forward(x)
        assert not (self.weight.requires_grad or (self.bias is not None and self.bias.requires_grad)), \
            "UpcastLinear computes no gradient for its weight or bias: it is for a frozen LoRA base"
        return _UpcastLinearFn.apply(x, self.weight, self.bias)


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Adapted layers of `model` by full module name (empty when peft was never imported: nothing is adapted)."""
    if "peft" not in sys.modules:
        return {}
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


@torch.no_grad()
def merged_weight(layer: nn.Module) -> torch.Tensor:
    """W + (alpha/rank)·B·A of one adapted linear layer, a new tensor ([out, in]) in the adapters' dtype (the
    model's; W itself may be kept narrower, `store_frozen_base`)."""
    weight = layer.get_base_layer().weight
    # Added in the promoted dtype and rounded once, as peft's own merge does.
    return (weight + layer.get_delta_weight(ADAPTER)).to(layer.lora_A[ADAPTER].weight.dtype)


def merged_targets(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(plain HF name, merged weight) of every adapted layer, in module order: the only tensors LoRA changes."""
    return [(f"{name}.weight", merged_weight(layer)) for name, layer in lora_layers(model).items()]


def target_weight_names(model: nn.Module, cfg: LoraConfig) -> list[str]:
    """The names `merged_targets` sends, resolved on a plain (unadapted) copy of the same model."""
    return [f"{name}.weight" for name in resolve_targets(model, cfg.targets)]


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict under plain HF names with every adapter merged (`model.state_dict()` itself
    when nothing is adapted): what export, delta checkpoints and full-state weight sync read."""
    layers = lora_layers(model)
    state = model.state_dict()
    if not layers:
        return state
    merged = dict(merged_targets(model))
    out = {}
    for key, tensor in state.items():
        if ".lora_" in key:
            continue
        plain = key.replace(".base_layer.", ".")
        out[plain] = merged.get(plain, tensor)
    return out


def adapter_keys(model: nn.Module) -> list[str]:
    """State-dict keys of the trainable adapter tensors (what a LoRA checkpoint stores)."""
    return [name for name, p in model.named_parameters() if p.requires_grad]
