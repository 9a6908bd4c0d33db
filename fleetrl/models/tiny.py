"""A word-level tokenizer and a randomly initialised causal LM small enough for unit tests and the quickstart.

Nothing is downloaded: the tokenizer is built in memory from a word list, and the model is a 2-layer Llama
(or Qwen2, Qwen3, Mistral: `tiny:arch=...`) whose weights depend only on `seed`. `save_tiny` writes both to a folder that the ordinary
`load_causal_lm` / `load_tokenizer` read back, so code paths that load from disk are exercised too.
"""
from __future__ import annotations

from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedModel, PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>", "<bos>")
DEFAULT_WORDS = (
    tuple(str(d) for d in range(10))
    + tuple(chr(c) for c in range(ord("a"), ord("z") + 1))
    + ("copy", "add", "next", "first", "last", "=", "+", "?", ":", "user", "assistant", "system")
)

# "user : copy a b assistant :" for one user message with add_generation_prompt=True.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if not loop.first %} {% endif -%}"
    "{{ message['role'] }} : {{ message['content'] }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{%- if messages %} {% endif -%}assistant :{%- endif -%}"
)

ARCHS = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
         "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
         "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
         "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}


def build_tiny_tokenizer(vocab: list[str] | None = None) -> PreTrainedTokenizerFast:
    """Word-level tokenizer over `vocab` (default: the special tokens + digits + a-z + a few task words).

    Text is split on whitespace and each piece must be a vocab word (else `<unk>`); decoding joins with spaces.
    The four special tokens are always ids 0..3 whatever `vocab` says, so pad/eos/unk/bos ids are stable.
    """
    words = list(DEFAULT_WORDS if vocab is None else vocab)
    ordered = list(SPECIAL_TOKENS) + [w for w in dict.fromkeys(words) if w not in SPECIAL_TOKENS]
    bad = [w for w in ordered if not w or any(ch.isspace() for ch in w)]
    if bad:
        raise ValueError(f"tiny tokenizer vocab words must be non-empty and contain no whitespace; got {bad!r}")
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(ordered)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # The WordPiece decoder joins tokens with single spaces and glues on tokens that start with `prefix`.
    # WhitespaceSplit never yields a token starting with " ", so with that prefix it is a plain space-join.
    backend.decoder = decoders.WordPiece(prefix=" ", cleanup=False)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", bos_token="<bos>",
        padding_side="left",
        # HF's clean-up would turn "a ?" into "a?" and break the space-joined round trip.
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int = 128,
    max_position_embeddings: int = 256,
    seed: int = 0,
    arch: str = "llama",
    tie_word_embeddings: bool = False,
) -> PreTrainedModel:
    """A randomly initialised fp32 causal LM whose weights depend only on the arguments (not on global RNG).
    tie_word_embeddings: the LM head is the input embedding (SmolLM2, Qwen2.5-0.5B), as `tiny:tie=1`."""
    if arch not in ARCHS:
        raise ValueError(f"tiny model arch {arch!r} is not supported; choose one of {sorted(ARCHS)}")
    if hidden_size % num_heads:
        raise ValueError(f"tiny model hidden_size={hidden_size} must be a multiple of num_heads={num_heads}")
    config_cls, model_cls = ARCHS[arch]
    # Qwen3Config defaults head_dim to 128 whatever the hidden size; a tiny model keeps hidden / heads, as the others.
    # (Mistral's default sliding window, 4096 tokens, is wider than any tiny sequence.)
    head_dim = {"head_dim": hidden_size // num_heads} if arch == "qwen3" else {}
    config = config_cls(
        **head_dim,
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=bool(tie_word_embeddings),
        # Eager attention: the incremental (KV-cache) path of `generate` and a full forward pass then agree to
        # ~1e-7 on CPU, which the engine-vs-trainer logprob tests rely on.
        attn_implementation="eager",
    )
    config.dtype = torch.float32
    # fork_rng: seeding here must not disturb the caller's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model.to(torch.float32).eval()


def save_tiny(path: str | Path, *, vocab: list[str] | None = None, **model_kwargs: object) -> Path:
    """Builds the tiny tokenizer + model (kwargs as in `build_tiny_model`) and saves both under `path`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(vocab)
    model = build_tiny_model(tokenizer, **model_kwargs)  # type: ignore[arg-type]
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
