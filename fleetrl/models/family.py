"""The decoder families fleetrl runs with its own code, defined once: the fast rollout engine (engines/fast) and the
native training forward (models/decoder.py) both read a model's shape and its family's rules from here, and its
two ops that must equal HF's op for op (RMSNorm, RoPE). Models import nothing from engines; engines import this.

The four families share one layer: pre-norm RMSNorm, RoPE, GQA attention, SwiGLU MLP. They differ in what
`read_spec` picks up: q/k/v (and o) biases where the config has them (Qwen2; Qwen3 with attention_bias), Qwen3's
per-head RMSNorm of q and k before RoPE (`q_norm`/`k_norm`), a head dim that is not hidden / heads (Qwen3,
Mistral's `head_dim`), and sliding-window attention, which is refused where it could change a result
(`read_spec`, `check_window`). Which tensors hold the weights is the engine's reading (engines/fast/arch.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fleetrl.config.families import SUPPORTED_MODEL_TYPES, family_gap  # the list, torch-free: the Plan reads it too

# RoPE variants whose frequencies do not depend on the sequence length, so one precomputed table is exact.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True, kw_only=True, slots=True)
class DecoderSpec:
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    rms_eps: float
    # Qwen3: q and k pass through a per-head RMSNorm (weights LayerWeights.qn/kn, eps rms_eps) before RoPE.
    qk_norm: bool = False
    # Mistral's sliding window (keys within the last `attention_window` positions, the query's own included);
    # None: full causal attention. Every forward here attends fully, which equals the window only while no
    # sequence is longer than it: `check_window` refuses lengths past it.
    attention_window: int | None = None

    @property
    def group(self) -> int:
        """Query heads per KV head (GQA group size)."""
        return self.num_heads // self.num_kv_heads


def read_spec(model: torch.nn.Module) -> DecoderSpec:
    """Validates that `model` is a decoder this engine's forward reproduces exactly, and returns its shape. A
    Mistral window is returned, not judged: the lengths it must cover are the caller's (`check_window`)."""
    cfg = model.config
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"FastRolloutEngine supports model types {SUPPORTED_MODEL_TYPES}, got {cfg.model_type!r}"
                         f"{family_gap(cfg.model_type)}; "
                         "set rollout.engine=vllm (vLLM's kernels, with its own copy of the weights) or "
                         "rollout.engine=hf (transformers' generate, any architecture: 14.8x slower decode than "
                         "fast for Qwen3-8B on an H200, bench/RESULTS.md)")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise ValueError(f"FastRolloutEngine implements the SwiGLU MLP (hidden_act='silu'), got {cfg.hidden_act!r}")
    sliding = _sliding_layers(cfg)
    if sliding:
        raise ValueError(f"{cfg.model_type} config.use_sliding_window=True with max_window_layers="
                         f"{getattr(cfg, 'max_window_layers', None)} gives layers {sliding} sliding-window attention "
                         "(config.layer_types), which FastRolloutEngine does not implement; set "
                         "config.use_sliding_window=False (or max_window_layers >= num_hidden_layers) or use the "
                         "'hf' engine")
    rope_type = getattr(model.model.rotary_emb, "rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise ValueError(f"RoPE type {rope_type!r} depends on the sequence length; FastRolloutEngine supports "
                         f"{STATIC_ROPE_TYPES} (use the 'hf' engine for this model)")
    heads, kv_heads = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    return DecoderSpec(num_layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, num_heads=heads,
                       num_kv_heads=kv_heads, head_dim=head_dim, vocab=cfg.vocab_size, rms_eps=cfg.rms_norm_eps,
                       qk_norm=_has_qk_norm(model), attention_window=_mistral_window(cfg))


def check_window(spec: DecoderSpec, max_len: int, what: str) -> None:
    """Refuses a Mistral sliding window narrower than `max_len`, the longest sequence (prompt + response) a forward
    may see (`what` names where that bound comes from). Why refuse and not implement the window: HF masks keys
    more than `sliding_window - 1` positions back, so up to the window full causal attention is exactly HF's
    forward, and past it no forward here (prefill, decode, Triton kernel, native training forward) would be."""
    window = spec.attention_window
    if window is not None and max_len > window:
        raise ValueError(f"mistral config.sliding_window={window} is shorter than {what}={max_len}; the fast engine "
                         "and native forward attend to the whole sequence, which equals the sliding window only for "
                         f"sequences of at most {window} tokens: keep data.max_prompt_length + "
                         f"rollout.max_response_tokens <= {window}, or use the 'hf' engine / actor.forward=hf")


def _sliding_layers(cfg: object) -> list[int]:
    """The layers HF runs with a sliding window under Qwen2/Qwen3's use_sliding_window (those from max_window_layers
    on, as config.layer_types lists them); [] when it is off, or for a family without the switch (Mistral's
    window applies to every layer and is `_mistral_window`'s)."""
    if not getattr(cfg, "use_sliding_window", False) or getattr(cfg, "sliding_window", None) is None:
        return []
    types = getattr(cfg, "layer_types", None)
    if types is None:  # configs from before layer_types: the rule that fills it in
        first = getattr(cfg, "max_window_layers", 0)
        return list(range(first, cfg.num_hidden_layers))
    return [i for i, kind in enumerate(types) if kind == "sliding_attention"]


def _mistral_window(cfg: object) -> int | None:
    """Mistral's sliding window, which its attention applies to every layer whenever config.sliding_window is set
    (no use_sliding_window switch, unlike Qwen2/Qwen3)."""
    if cfg.model_type != "mistral":
        return None
    window = getattr(cfg, "sliding_window", None)
    return int(window) if window is not None else None


def _has_qk_norm(model: torch.nn.Module) -> bool:
    """Whether the attention normalises q and k per head (Qwen3), read from the modules the forward will read."""
    att = model.model.layers[0].self_attn
    return getattr(att, "q_norm", None) is not None and getattr(att, "k_norm", None) is not None




def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm/Qwen2RMSNorm, op for op; weight None: folded into the next projection (engines/fast/fused.py)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return h.to(x.dtype) if weight is None else weight * h.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, as HF's apply_rotary_pos_emb (cos/sin broadcast over heads)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
