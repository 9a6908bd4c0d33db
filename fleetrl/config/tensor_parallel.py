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


def known_shape(model_path: str) -> tuple[int, int, int] | None:
    """(num_heads, num_kv_heads, intermediate_size) of a `random:` or `tiny:` model, read from their specs without
    building anything, or of a local checkpoint folder from its config.json; None otherwise (a hub id, a GGUF file:
    the engine checks when the model loads)."""
    if model_path.startswith("random:"):
        from fleetrl.models.shapes import QWEN3, QWEN25

        shape = {**QWEN25, **QWEN3}.get(model_path[len("random:"):])
        if shape is None:
            return None  # an unknown shape is refused where the model loads, with the known ones listed
        return (shape["num_attention_heads"], shape["num_key_value_heads"], shape["intermediate_size"])
    if model_path.startswith("tiny:"):
        import inspect

        from fleetrl.models.hf import _parse_tiny
        from fleetrl.models.tiny import build_tiny_model

        defaults = {name: p.default for name, p in inspect.signature(build_tiny_model).parameters.items()}
        try:
            kw = {**defaults, **_parse_tiny(model_path)}
        except ValueError:  # a bad spec is model.path's own error, reported where it is checked
            return None
        return (kw["num_heads"], kw["num_heads"], kw["intermediate_size"])  # tiny: kv heads = heads
    return _folder_shape(model_path)


def _folder_shape(model_path: str) -> tuple[int, int, int] | None:
    import json
    from pathlib import Path

    try:
        cfg = json.loads((Path(model_path).expanduser() / "config.json").read_text())
        heads = int(cfg["num_attention_heads"])
        return heads, int(cfg.get("num_key_value_heads") or heads), int(cfg["intermediate_size"])
    except (OSError, ValueError, KeyError, TypeError):  # not a folder, or not a decoder config this reads
        return None
