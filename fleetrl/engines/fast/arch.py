"""What the fast engine reads from a Hugging Face Llama / Qwen2 / Qwen3 / Mistral decoder: its shape and its weight
tensors.

The four families share one layer: pre-norm RMSNorm, RoPE, GQA attention, SwiGLU MLP. They differ in what
`read_spec` and `model_weights` pick up: q/k/v (and o) biases where the config has them (Qwen2; Qwen3 with
attention_bias), Qwen3's per-head RMSNorm of q and k before RoPE (`q_norm`/`k_norm`, LayerWeights.qn/kn), a head
dim that is not hidden / heads (Qwen3, Mistral's `head_dim`), and sliding-window attention, which is refused
where it could change a result (`read_spec`, `check_window`).

Weights are looked up on the HF modules every time `model_weights` is called and are never copied here: when
the engine is colocated with the trainer it decodes with the trainer's own parameters, so an optimizer step is
visible to the next `generate` with no weight sync (fused.py's q/k/v and gate/up copies, an engine option,
are refreshed when the engine is told the weights changed). (CUDA graphs bake the tensors' addresses in; the engine
compares `weight_fingerprint` before each call and re-captures if a parameter was re-allocated.)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

# The family's definition (shape, norms, RoPE, sliding-window rules) lives in models/family.py, which the native
# training forward reads too; re-exported here for the engine's modules.
from fleetrl.models.family import (  # noqa: F401
    STATIC_ROPE_TYPES,
    SUPPORTED_MODEL_TYPES,
    DecoderSpec,
    check_window,
    read_spec,
)


@dataclass(frozen=True, slots=True)
class LayerWeights:
    ln1: torch.Tensor | None  # None: folded into wqkv (fused.py fold_norms), as ln2 into wgu
    wq: torch.Tensor
    bq: torch.Tensor | None
    wk: torch.Tensor
    bk: torch.Tensor | None
    wv: torch.Tensor
    bv: torch.Tensor | None
    wo: torch.Tensor
    bo: torch.Tensor | None
    ln2: torch.Tensor | None
    wg: torch.Tensor
    bg: torch.Tensor | None
    wu: torch.Tensor
    bu: torch.Tensor | None
    wd: torch.Tensor
    bd: torch.Tensor | None
    # Fused copies (fused.py), None when the engine reads the projections separately: wq/wk/wv (wg/wu) are then
    # row views of wqkv [q + 2 kv, hidden] (wgu [2 I, hidden]), so both names read the same memory.
    wqkv: torch.Tensor | None = None
    bqkv: torch.Tensor | None = None
    wgu: torch.Tensor | None = None
    bgu: torch.Tensor | None = None
    # Qwen3's per-head q/k RMSNorm weights [head_dim], None for the other families. Never folded (fused.py): the
    # norm divides by each head's own rms after the projection, which no weight scaling can express.
    qn: torch.Tensor | None = None
    kn: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class ModelWeights:
    embed: torch.Tensor      # [V, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor       # [hidden]
    lm_head: torch.Tensor    # [V, hidden]; the same tensor as `embed` when tied

    def tensors(self) -> list[torch.Tensor]:
        out = [self.embed, self.norm, self.lm_head]
        for lw in self.layers:
            out.extend(t for t in (getattr(lw, f) for f in LayerWeights.__slots__) if t is not None)
        return out


def _bias(linear: torch.nn.Module) -> torch.Tensor | None:
    return linear.bias if getattr(linear, "bias", None) is not None else None


def model_weights(model: torch.nn.Module) -> ModelWeights:
    """The model's current parameter tensors (no copies; `.data` of each parameter)."""
    return ModelWeights(model.model.embed_tokens.weight.data, [layer_weights(layer) for layer in model.model.layers],
                        model.model.norm.weight.data, model.lm_head.weight.data)


def layer_weights(layer: torch.nn.Module) -> LayerWeights:
    """One decoder layer's current parameter tensors (no copies)."""
    att, mlp = layer.self_attn, layer.mlp
    return LayerWeights(
        layer.input_layernorm.weight.data,
        att.q_proj.weight.data, _data(_bias(att.q_proj)), att.k_proj.weight.data, _data(_bias(att.k_proj)),
        att.v_proj.weight.data, _data(_bias(att.v_proj)), att.o_proj.weight.data, _data(_bias(att.o_proj)),
        layer.post_attention_layernorm.weight.data,
        mlp.gate_proj.weight.data, _data(_bias(mlp.gate_proj)), mlp.up_proj.weight.data, _data(_bias(mlp.up_proj)),
        mlp.down_proj.weight.data, _data(_bias(mlp.down_proj)),
        qn=_norm_weight(att, "q_norm"), kn=_norm_weight(att, "k_norm"))


# LayerWeights field -> the projection it reads, under a decoder layer (the modules LoRA may adapt here).
PROJECTIONS = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
               "wo": "self_attn.o_proj", "wg": "mlp.gate_proj", "wu": "mlp.up_proj", "wd": "mlp.down_proj"}


def merged_weights(model: torch.nn.Module, into: ModelWeights | None = None,
                   dtype: torch.dtype | None = None) -> ModelWeights | None:
    """`model_weights` with every LoRA-adapted projection replaced by its merged W + ΔW (fleetrl/models/lora.py);
    None when nothing is adapted. The merged tensors are new, or written in place into `into`'s (whose
    addresses CUDA graphs may hold); every other tensor is still the model's own. With `dtype` each merged
    tensor is rounded to it as soon as it is made, so a decode in another dtype never holds every projection
    twice at the model's precision (SmolLM2, all-linear: 0.42 GiB of fp32 merges)."""
    from fleetrl.models.lora import lora_layers

    adapted = lora_layers(model)
    if not adapted:
        return None
    base = model_weights(model)
    check_adapted(adapted, len(base.layers))
    layers = [merged_layer(lw, i, adapted, None if into is None else into.layers[i], dtype)
              for i, lw in enumerate(base.layers)]
    return ModelWeights(base.embed, layers, base.norm, merged_head(base.lm_head, adapted, into, dtype))


def check_adapted(adapted: dict[str, torch.nn.Module], num_layers: int) -> None:
    """The fast engine merges adapters on the projections of PROJECTIONS and the LM head only."""
    known = {f"model.layers.{i}.{path}" for i in range(num_layers) for path in PROJECTIONS.values()}
    if set(adapted) - known - {"lm_head"}:
        raise ValueError(f"the fast engine merges LoRA adapters on the attention/MLP projections and the LM head "
                         f"only; {sorted(set(adapted) - known)[:3]} are adapted too: narrow actor.lora.targets or use "
                         "rollout.engine=hf")


def merged_layer(lw: LayerWeights, i: int, adapted: dict[str, torch.nn.Module], into: LayerWeights | None = None,
                 dtype: torch.dtype | None = None) -> LayerWeights:
    """Decoder layer i's weights `lw` with each projection `adapted` names (lora_layers' keys) merged, W + ΔW: a
    new tensor, or written in place into `into`'s; rounded to `dtype` where given."""
    from fleetrl.models.lora import merged_weight

    fields = {}
    for field, path in PROJECTIONS.items():
        layer = adapted.get(f"model.layers.{i}.{path}")
        if layer is not None:
            fields[field] = merged_weight(layer) if dtype is None else merged_weight(layer).to(dtype)
            if into is not None:
                fields[field] = getattr(into, field).copy_(fields[field])
    return dataclasses.replace(lw, **fields) if fields else lw


def merged_head(lm_head: torch.Tensor, adapted: dict[str, torch.nn.Module], into: ModelWeights | None = None,
                dtype: torch.dtype | None = None) -> torch.Tensor:
    """The LM head, merged where adapted (only an untied head may be: models/lora.py refuses a tied one)."""
    from fleetrl.models.lora import merged_weight

    if "lm_head" not in adapted:
        return lm_head
    merged = merged_weight(adapted["lm_head"]) if dtype is None else merged_weight(adapted["lm_head"]).to(dtype)
    return into.lm_head.copy_(merged) if into is not None else merged


def cast_weights(weights: ModelWeights, dtype: torch.dtype) -> ModelWeights:
    """A copy of every tensor in `dtype`; a tied lm_head stays one tensor with the embedding."""
    def cast(t: torch.Tensor | None) -> torch.Tensor | None:
        # A tensor already in `dtype` is a merge made for this call (merged_weights(dtype=...)), never the
        # model's own (the engine casts only when the model's dtype differs): no second copy.
        return None if t is None else t if t.dtype == dtype else t.to(dtype, copy=True)

    embed = cast(weights.embed)
    lm_head = embed if weights.lm_head is weights.embed else cast(weights.lm_head)
    layers = [LayerWeights(*(cast(getattr(lw, f)) for f in LayerWeights.__slots__)) for lw in weights.layers]
    return ModelWeights(embed, layers, cast(weights.norm), lm_head)


def _data(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.data


def _norm_weight(att: torch.nn.Module, name: str) -> torch.Tensor | None:
    """The weight of the attention's per-head norm `name` (Qwen3's q_norm / k_norm); None where it has none."""
    norm = getattr(att, name, None)
    return None if norm is None else norm.weight.data


def weight_fingerprint(weights: ModelWeights) -> tuple[int, ...]:
    return tuple(t.data_ptr() for t in weights.tensors())


def rope_tables(model: torch.nn.Module, max_seq_len: int, dtype: torch.dtype,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_seq_len, head_dim] in the model dtype, computed exactly as HF's rotary module does
    (fp32 position * inv_freq, duplicated halves, times attention_scaling, then cast), from its own inv_freq."""
    rotary = model.model.rotary_emb
    inv_freq = rotary.inv_freq.detach().to(device=device, dtype=torch.float32)
    pos = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    scale = float(getattr(rotary, "attention_scaling", 1.0))
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)
