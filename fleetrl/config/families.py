"""The decoder families fleetrl's own code runs (the fast rollout engine and the native training forward), named
torch-free so the Plan can refuse another family before anything starts. models/family.py defines what each family
is (its shape and rules); this is only the list, which it imports from here.
"""
from __future__ import annotations

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


# What the fast engine and the native forward lack for the families users ask about most: each one's differences
# from the decoders above, read from its Hugging Face modelling code and configs. A refusal names them, so a user
# knows the gap is real and what closing it would take.
_GEMMA = "the embedding scaled by sqrt(hidden_size), (1 + w) RMSNorms and a GELU-tanh MLP"
_GEMMA_LATER = (f"{_GEMMA}, attention scaled by query_pre_attn_scalar, a second norm after attention and after the "
                "MLP, and sliding-window attention on some layers")
MISSING = {
    "gemma": _GEMMA,
    "gemma2": f"{_GEMMA_LATER} (every other layer), attention-logit and final-logit soft-capping",
    "gemma3": f"{_GEMMA_LATER} (5 of every 6, with their own RoPE base) and per-head q/k norms",
    "gemma3_text": f"{_GEMMA_LATER} (5 of every 6, with their own RoPE base) and per-head q/k norms",
    "phi3": "fused qkv_proj and gate_up_proj weights and, in its long-context versions, LongRoPE scaling",
    "mixtral": "mixture-of-experts MLPs (a router and experts in every layer)",
    "qwen2_moe": "mixture-of-experts MLPs (a router, experts and a shared expert in every layer)",
    "qwen3_moe": "mixture-of-experts MLPs (a router and experts in every layer)",
}


def family_gap(model_type: str) -> str:
    """"; its decoder needs ..., which they do not implement" for a family in MISSING, else ""."""
    missing = MISSING.get(model_type)
    return f"; its decoder needs {missing}, which they do not implement" if missing else ""


def family_problem(model_type: str | None, *, engine: str, forward: str) -> str | None:
    """None when the fast engine and the native forward (where chosen) run `model_type` (None: not known before
    the model loads; the engine and the forward check it when they build), else what to set instead and what it
    costs (bench/RESULTS.md: HF generate decoded Qwen3-8B 14.8x slower than fast on an H200; the HF forward ran the
    0.5B update 1.5x slower than native)."""
    if model_type is None or model_type in SUPPORTED_MODEL_TYPES:
        return None
    if engine == "fast":
        return (f"rollout.engine=fast runs the decoder families {', '.join(SUPPORTED_MODEL_TYPES)}; this model's "
                f"model_type is {model_type!r}{family_gap(model_type)}: set rollout.engine=vllm (vLLM's kernels, its "
                "own copy of the weights) or rollout.engine=hf (any architecture; 14.8x slower decode than fast for Qwen3-8B on an H200)")
    if forward == "native":
        return (f"actor.forward=native runs the decoder families {', '.join(SUPPORTED_MODEL_TYPES)}; this model's "
                f"model_type is {model_type!r}{family_gap(model_type)}: set actor.forward=hf (HF's modelling code; "
                "the 0.5B GPU update ran 1.5x slower than native)")
    return None
