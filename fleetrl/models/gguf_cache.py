"""GGUF models dequantised once per machine: the float weights and the converted tokenizer are kept as a transformers
folder in the user cache (fleetrl/cachedir.py), so later loads read safetensors instead of dequantising again.

Why: transformers dequantises a GGUF file tensor by tensor in numpy at every load, and converts its tokenizer too:
SmolLM2-135M (`smollm2-135m`) took 17 s for the weights and 4 s for the tokenizer on the 2-core VM and ~25 s before
the first step on an H200 host, in every worker of every run. From the cache both load in about a second.

The cache key is the GGUF file (resolved path, size, modification time), the dtype and the transformers version
(its dequantisation and tokenizer conversion define what the folder holds). A folder is written under a temporary
name and renamed when complete, so a reader never sees half of one; two processes converting at once both succeed
and one folder stays. Deleting the cache at any time only costs the next load its conversion.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from fleetrl.cachedir import user_cache_dir

COMPLETE = "fleetrl-complete"  # written last: a folder without it is ignored (and replaced)


def cache_folder(gguf_path: Path, what: str) -> Path:
    """Where the converted `what` ("float32", "bfloat16", ..., or "tokenizer") of `gguf_path` is kept."""
    import transformers

    st = gguf_path.stat()
    key = f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{what}|{transformers.__version__}"
    return user_cache_dir("gguf", f"{gguf_path.stem}-{what}-{hashlib.sha256(key.encode()).hexdigest()[:16]}")


def cached(folder: Path) -> bool:
    return (folder / COMPLETE).is_file()


def store(obj: Any, folder: Path) -> None:
    """Saves a dequantised model or a tokenizer (save_pretrained) as `folder`, atomically; a failure to write the
    cache (read-only home, full disk) only costs the next load its conversion, so it never fails the load."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    except OSError:
        return
    try:
        obj.save_pretrained(tmp)
        (tmp / COMPLETE).write_text("")
        shutil.rmtree(folder, ignore_errors=True)  # an incomplete folder of an interrupted save, if any
        os.rename(tmp, folder)  # fails if another process renamed its copy first: that one stays
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def forget_dequantised_gguf(model: Any) -> None:
    """Drops the GGUF quantizer transformers (5.x) keeps on a model it dequantised at load (`smollm2-135m`,
    `gguf:FILE`): its weights are plain float tensors, yet `save_pretrained` refuses it ("The model is quantized
    with gguf and is not serializable"), a kept `quantization_config` would make config.json ask for GGUF loading,
    and transformers' Trainer refuses to fine-tune a model still flagged `is_quantized` (TRL's GRPOTrainer in
    bench/race_trl.py). load_causal_lm applies it to each fresh conversion, before caching it, so every GGUF model
    it returns (converted or cached) is free of it: export and any Trainer rely on that. A model with packed
    (integer) GGUF weights is left for save_pretrained to refuse."""
    quantizer = getattr(model, "hf_quantizer", None)
    method = getattr(getattr(quantizer, "quantization_config", None), "quant_method", None)
    if str(getattr(method, "value", method)) != "gguf":
        return
    if not all(t.is_floating_point() for t in model.state_dict().values()):
        return
    model.hf_quantizer = None
    if getattr(model, "is_quantized", False):
        model.is_quantized = False  # an attribute set at load
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
