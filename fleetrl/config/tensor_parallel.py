"""Which tensor-parallel degrees a decoder's shape allows (the fast engine's `tensor_parallel` groups, engines/fast/tp.py).

Megatron-style TP splits whole attention heads and whole MLP columns: every rank holds num_heads / k query heads,
num_kv_heads / k KV heads (no KV head is replicated) and intermediate / k MLP columns. So k must divide all three.
Torch-free: the Plan calls it with a model shape read without loading the model.
"""
from __future__ import annotations


def tp_degrees(num_heads: int, num_kv_heads: int, intermediate: int | None = None) -> list[int]:
    """Every k that divides num_heads, num_kv_heads (and intermediate, where given)."""
    return [k for k in range(1, num_kv_heads + 1)
            if num_heads % k == 0 and num_kv_heads % k == 0 and (intermediate is None or intermediate % k == 0)]


def tp_shape_problem(k: int, num_heads: int, num_kv_heads: int, intermediate: int | None = None) -> str | None:
    """None when tensor parallelism of degree k can split this shape, else what does not divide and the k that would."""
    if k < 1:
        return f"the tensor-parallel degree must be >= 1, got {k}"
    bad = [f"{name}={n}" for name, n in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                                         ("intermediate_size", intermediate)) if n is not None and n % k]
    if not bad:
        return None
    return (f"{' and '.join(bad)} not divisible by the tensor-parallel degree {k} (each rank holds whole heads, "
            f"KV heads and MLP columns); degrees that divide this model: "
            f"{', '.join(map(str, tp_degrees(num_heads, num_kv_heads, intermediate)))}")


def folder_config(model_path: str) -> dict | None:
    """A local checkpoint folder's config.json, read without loading anything; None for anything else (a hub id, a
    GGUF file, a `random:` or `tiny:` model: those shapes live in the models layer, `models/shapes.py`)."""
    import json
    from pathlib import Path

    try:
        cfg = json.loads((Path(model_path).expanduser() / "config.json").read_text())
    except (OSError, ValueError):  # not a folder, or not JSON
        return None
    return cfg if isinstance(cfg, dict) else None


def folder_shape(model_path: str) -> tuple[int, int, int] | None:
    """(num_heads, num_kv_heads, intermediate_size) of a local checkpoint folder's config.json; None where there is
    none or it is not a decoder config this reads (the engine checks those shapes when it builds, engines/fast/tp.py)."""
    return config_shape(folder_config(model_path))


def config_shape(cfg: dict | None) -> tuple[int, int, int] | None:
    """folder_shape's reading of an already loaded config.json (None: no folder)."""
    try:
        heads = int(cfg["num_attention_heads"])
        return heads, int(cfg.get("num_key_value_heads") or heads), int(cfg["intermediate_size"])
    except (KeyError, TypeError, ValueError):
        return None
