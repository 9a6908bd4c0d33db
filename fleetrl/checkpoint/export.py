"""Turning a training checkpoint into a Hugging Face model folder.

A checkpoint is the folder `OUT/checkpoints/step_N/` written by fleetrl/checkpoint/manager.py:

  meta.json   {"step": N, "model_path": "...", "tokenizer_path": "...", "dtype": "float32", ...}
  actor/      a torch.distributed.checkpoint (DCP) folder holding {"model": <the causal LM's state_dict()>}, or
              with meta["lora"] only the adapters' tensors (the base is model_path itself)

DCP stores tensors without the module structure, so reading it needs a template state dict of the right
shapes: we build the run's base model (`meta["model_path"]`) and load the saved tensors into its state dict in
place. That works in a plain single process on CPU; no process group is needed. A LoRA checkpoint is loaded into
the base model with the same adapters injected, then merged (W + (alpha/rank)·B·A) and unwrapped: what export
writes is a plain model of the base architecture.
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fleetrl.checkpoint.integrity import validate_checkpoint
from fleetrl.config.load import build
from fleetrl.config.schema import LoraConfig
from fleetrl.errors import UserError
from fleetrl.models.hf import DTYPES, load_causal_lm, load_tokenizer
from fleetrl.models.lora import adapter_keys, apply_lora

META_FILE = "meta.json"
ACTOR_DIR = "actor"
DCP_KEY = "model"  # the top-level key the manager saves the model's state dict under
META_KEYS = ("step", "model_path", "tokenizer_path", "dtype")
# DCP warns on every call that it assumes a single process when no process group exists; that is our intent.
_SINGLE_PROCESS_WARNING = r"torch\.distributed is disabled, unavailable or uninitialized"


class CheckpointError(UserError, ValueError):
    """A checkpoint folder that cannot be read; the message names the path and what to do about it."""


def read_meta(ckpt_dir: str | Path) -> dict:
    """meta.json of `ckpt_dir`, checked for the keys export needs."""
    ckpt_dir = Path(ckpt_dir)
    meta_path = ckpt_dir / META_FILE
    if not ckpt_dir.exists():
        raise CheckpointError(f"checkpoint {str(ckpt_dir)!r} does not exist (resolved to "
                              f"{str(ckpt_dir.absolute())!r}). {_where_checkpoints_are(ckpt_dir)}")
    if not meta_path.is_file():
        raise CheckpointError(f"{str(ckpt_dir)!r} is not a fleetrl checkpoint: it has no {META_FILE}. "
                              f"{_where_checkpoints_are(ckpt_dir)}")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{str(meta_path)!r} is not valid JSON ({err}); the save was probably interrupted, "
                              "use an earlier step_N checkpoint") from None
    missing = [key for key in META_KEYS if key not in meta]
    if missing:
        raise CheckpointError(f"{str(meta_path)!r} lacks {missing}; expected at least {list(META_KEYS)} "
                              "(add them by hand if you know the run's model.path and dtype)")
    if meta["dtype"] not in DTYPES:
        raise CheckpointError(f"{str(meta_path)!r} has dtype {meta['dtype']!r}; expected one of {sorted(DTYPES)}")
    return meta


def load_actor_state(ckpt_dir: str | Path) -> dict[str, Tensor]:
    """The actor's weights saved in `ckpt_dir`, keyed like `load_causal_lm(meta["model_path"]).state_dict()`."""
    model, _ = load_actor_model(ckpt_dir)
    return model.state_dict()


def load_actor_model(ckpt_dir: str | Path) -> tuple[PreTrainedModel, dict]:
    """(the base model with the checkpoint's weights loaded into it, meta.json)."""
    ckpt_dir = Path(ckpt_dir)
    meta = read_meta(ckpt_dir)
    actor_dir = ckpt_dir / ACTOR_DIR
    if not (actor_dir / ".metadata").is_file():
        found = "has no .metadata file" if actor_dir.is_dir() else "does not exist"
        raise CheckpointError(f"checkpoint {str(ckpt_dir)!r} is incomplete: {str(actor_dir)!r} {found} (a DCP "
                              "save that was interrupted?); use an earlier step_N checkpoint")
    try:
        model = load_causal_lm(meta["model_path"], dtype=meta["dtype"])
    except ValueError as err:
        raise CheckpointError(f"checkpoint {str(ckpt_dir)!r} was trained from model_path {meta['model_path']!r}, "
                              f"which cannot be loaded: {err}\nIf the base model moved, point model_path in "
                              f"{str(ckpt_dir / META_FILE)!r} at its new location") from err
    adapters = _inject_lora(model, meta, ckpt_dir) if meta.get("lora") else None
    template = model.state_dict()  # shares storage with the parameters, so loading fills the model in place
    if adapters is not None:  # the checkpoint holds the trainable tensors only
        template = {k: template[k] for k in adapter_keys(model)}
    _check_layout(actor_dir, template)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
        dcp.load({DCP_KEY: template}, checkpoint_id=str(actor_dir))
    if adapters is not None:
        model = adapters.merge_and_unload()
    return model, meta


def _inject_lora(model: PreTrainedModel, meta: dict, ckpt_dir: Path):  # noqa: ANN202 (a peft.PeftModel)
    try:
        cfg = build(LoraConfig, meta["lora"], "meta.json lora")
        return apply_lora(model, cfg)
    except ValueError as err:
        raise CheckpointError(f"checkpoint {str(ckpt_dir)!r}: its meta.json 'lora' entry {meta['lora']} does not fit "
                              f"the model {meta['model_path']!r}: {err}") from err


def export_hf(ckpt_dir: str | Path, out_dir: str | Path, *, dtype: str | None = None, verify: bool = True) -> Path:
    """Writes checkpoint `ckpt_dir` as a HF folder loadable by `AutoModelForCausalLM/AutoTokenizer.from_pretrained`.

    `dtype` (float32 | bfloat16 | float16) converts the weights; None keeps the checkpoint's dtype. `verify`
    hashes the actor's files against checksums.json first; the trainer, exporting what it has just written and
    hashed, skips that second read of every file.
    """
    check_export_dtype(dtype)  # before minutes of loading
    read_meta(ckpt_dir)  # says what a folder that is no checkpoint at all is, before the integrity check
    # A truncated shard otherwise fails deep in DCP with an EOFError.
    problem = validate_checkpoint(Path(ckpt_dir), only="actor") if verify else None
    if problem:
        raise CheckpointError(f"cannot export checkpoint {str(ckpt_dir)!r}: {problem}; use an earlier step_N "
                              "checkpoint")
    model, meta = load_actor_model(ckpt_dir)
    tokenizer = load_tokenizer(meta["tokenizer_path"])
    return write_hf_folder(model, tokenizer, out_dir, dtype=dtype)


def check_export_dtype(dtype: str | None) -> None:
    """Raises CheckpointError naming the `--dtype` flag unless `dtype` is None or a supported dtype."""
    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"--dtype {dtype!r} is not supported for export; expected one of {sorted(DTYPES)} "
                              "(or leave --dtype out to keep the checkpoint's dtype)")


def write_hf_folder(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out_dir: str | Path, *,
                    dtype: str | None = None) -> Path:
    """config.json, model.safetensors, generation_config.json and the tokenizer files under `out_dir`.

    A `dtype` converts `model` in place (HF's `.to`), to avoid holding a second copy of the weights.
    """
    check_export_dtype(dtype)
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise CheckpointError(f"export target (--hf) {str(out_dir)!r} is a file; pass a folder path")
    out_dir.mkdir(parents=True, exist_ok=True)
    if dtype is not None:
        model = model.to(DTYPES[dtype])
    model.save_pretrained(out_dir, safe_serialization=True)  # a GGUF base left load_causal_lm without its quantizer
    tokenizer.save_pretrained(out_dir)
    return out_dir


def _check_layout(actor_dir: Path, template: dict[str, Tensor]) -> None:
    """Raises if the DCP folder does not hold exactly the template's tensors and shapes (DCP's own errors on a
    mismatch are a stack of distributed-planner tracebacks)."""
    saved = dcp.FileSystemReader(str(actor_dir)).read_metadata().state_dict_metadata
    prefix = DCP_KEY + "."
    shapes = {key[len(prefix):]: tuple(meta.size) for key, meta in saved.items()
              if key.startswith(prefix) and hasattr(meta, "size")}
    missing = sorted(set(template) - set(shapes))
    wrong = [f"{key}: saved {shapes[key]}, model {tuple(template[key].shape)}" for key in template
             if key in shapes and shapes[key] != tuple(template[key].shape)]
    if missing or wrong:
        raise CheckpointError(f"{str(actor_dir)!r} does not match the model named by meta.json: "
                              f"{len(missing)} tensors missing {missing[:3]}, {len(wrong)} of a different shape "
                              f"{wrong[:3]}; check that model_path in meta.json is the model this run trained")


def _where_checkpoints_are(path: Path) -> str:
    """A hint for the common mistake of passing OUT or OUT/checkpoints instead of OUT/checkpoints/step_N."""
    for folder in (path, path / "checkpoints"):
        # step_N.tmp is a save in progress (or a crashed one), never a candidate.
        steps = sorted((p for p in folder.glob("step_*") if p.name[5:].isdigit()), key=lambda p: int(p.name[5:]))
        if steps:
            return f"Pass a step folder such as {str(steps[-1])!r} (the latest)."
    return "Expected OUT/checkpoints/step_N/ holding meta.json and actor/, as written by the checkpoint manager."
