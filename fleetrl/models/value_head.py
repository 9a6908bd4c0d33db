"""The PPO critic: a causal LM's transformer body with a scalar value head in place of the LM head."""
from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import PreTrainedModel

from fleetrl.models.meta_init import built_alike, mark_built_alike


def backbone_of(causal_lm: nn.Module) -> nn.Module:
    """The transformer body under a causal LM's head (`model.model` for Llama/Qwen2), found via HF's
    `base_model_prefix` so other architectures (`transformer` for GPT-2, ...) work too."""
    base = getattr(causal_lm, "base_model", None)
    if base is None or base is causal_lm:
        raise ValueError(f"{type(causal_lm).__name__} does not expose a base model under its LM head "
                         "(expected a transformers *ForCausalLM with `base_model_prefix`, e.g. LlamaForCausalLM)")
    return base


class CriticModel(nn.Module):
    """Backbone + `nn.Linear(hidden, 1)`; `forward` returns one value per token, [B, L] float32.

    The head is kept in float32 whatever the backbone's dtype: values are regression targets whose small
    differences (advantages) matter, and the head is tiny.
    """

    def __init__(self, backbone: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        device = next(backbone.parameters()).device
        self.value_head = nn.Linear(hidden_size, 1, device=device, dtype=torch.float32)
        # Zero init: every state starts with value 0, so the first PPO updates see advantages equal to the
        # (normalised) returns instead of noise from a random projection of large hidden states, and the value
        # loss starts at a scale set by the rewards alone.
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @property
    def config(self):  # noqa: ANN201 - the backbone's transformers config
        return self.backbone.config

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=False).last_hidden_state
        head_device = self.value_head.weight.device
        return self.value_head(hidden.to(head_device, torch.float32)).squeeze(-1)


def build_critic(causal_lm_or_path: PreTrainedModel | str, *, dtype: str = "float32") -> CriticModel:
    """A critic initialised from a causal LM's body. Given a model, its backbone is deep-copied (the critic
    trains separately from the actor); given a path, the model is loaded fresh (`dtype` applies only then)."""
    if isinstance(causal_lm_or_path, str):
        from fleetrl.models.hf import load_causal_lm

        backbone = backbone_of(load_causal_lm(causal_lm_or_path, dtype=dtype))
    else:
        backbone = copy.deepcopy(backbone_of(causal_lm_or_path))
    hidden_size = backbone.config.get_text_config().hidden_size
    critic = CriticModel(backbone, hidden_size)
    # Its head starts at zero: the critic of a model every rank built alike is built alike too (meta_init.py).
    alike = built_alike(causal_lm_or_path) if isinstance(causal_lm_or_path, nn.Module) else True
    return mark_built_alike(critic) if alike else critic
