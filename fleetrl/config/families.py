"""The decoder families fleetrl's own code runs (the fast rollout engine and the native training forward), named
torch-free so the Plan can refuse another family before anything starts. models/family.py defines what each family
is (its shape and rules); this is only the list, which it imports from here.
"""
from __future__ import annotations

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


def family_problem(model_type: str | None, *, engine: str, forward: str) -> str | None:
    """None when the fast engine and the native forward (where chosen) run `model_type` (None: not known before
    the model loads; the engine and the forward check it when they build), else what to set instead and what it
    costs (bench/RESULTS.md: HF generate decoded Qwen3-8B 14.8x slower than fast on an H200; the HF forward ran the
    0.5B update 1.5x slower than native)."""
    if model_type is None or model_type in SUPPORTED_MODEL_TYPES:
        return None
    if engine == "fast":
        return (f"rollout.engine=fast runs the decoder families {', '.join(SUPPORTED_MODEL_TYPES)}; this model's "
                f"model_type is {model_type!r}: set rollout.engine=vllm (vLLM's kernels, its own copy of the weights) "
                "or rollout.engine=hf (any architecture; 14.8x slower decode than fast for Qwen3-8B on an H200)")
    if forward == "native":
        return (f"actor.forward=native runs the decoder families {', '.join(SUPPORTED_MODEL_TYPES)}; this model's "
                f"model_type is {model_type!r}: set actor.forward=hf (HF's modelling code; the 0.5B GPU update ran "
                "1.5x slower than native)")
    return None
