import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fleetrl.models.tiny import build_tiny_model, build_tiny_tokenizer, save_tiny


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def test_default_vocab_ids(tok):
    # 4 specials + 10 digits + 26 letters + 12 words
    assert len(tok) == 52
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id, tok.bos_token_id) == (0, 1, 2, 3)
    assert tok.convert_tokens_to_ids(["0", "9", "a", "z", "copy", "system"]) == [4, 13, 14, 39, 40, 51]
    assert tok.padding_side == "left"


def test_encode_decode_round_trip(tok):
    ids = tok("copy a b  ?\nq")["input_ids"]
    assert ids == [40, 14, 15, 47, 30]  # no BOS added; any whitespace separates words
    assert tok.decode(ids) == "copy a b ? q"
    assert tok("copy zz")["input_ids"] == [40, tok.unk_token_id]
    assert tok.decode([14, 1, 0, 0], skip_special_tokens=True) == "a"
    assert tok.decode([14, 1], skip_special_tokens=False) == "a <eos>"


def test_chat_template_exact(tok):
    messages = [{"role": "system", "content": "copy"}, {"role": "user", "content": "copy a b"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "system : copy user : copy a b assistant :"
    assert tok.apply_chat_template(messages[1:], tokenize=False) == "user : copy a b"
    assert tok.decode(tok(text)["input_ids"]) == text


def test_left_padding(tok):
    batch = tok(["a b", "c"], padding=True, return_tensors="pt")
    assert batch["input_ids"].tolist() == [[14, 15], [0, 16]]
    assert batch["attention_mask"].tolist() == [[1, 1], [0, 1]]


def test_custom_vocab_keeps_special_ids():
    tok = build_tiny_tokenizer(["x", "y", "<eos>", "x"])
    assert len(tok) == 6 and tok.convert_tokens_to_ids(["x", "y"]) == [4, 5] and tok.eos_token_id == 1
    with pytest.raises(ValueError, match="whitespace"):
        build_tiny_tokenizer(["a b"])


def test_model_is_deterministic_for_seed(tok):
    rng = torch.get_rng_state()
    a, b, c = build_tiny_model(tok), build_tiny_model(tok), build_tiny_model(tok, seed=1)
    assert torch.equal(rng, torch.get_rng_state())  # building does not consume the caller's RNG
    for (k, va), vb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(va, vb), k
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    assert a.config.vocab_size == 52 and a.config.tie_word_embeddings is False
    assert a.dtype == torch.float32 and not a.training
    assert (a.config.pad_token_id, a.config.eos_token_id, a.config.bos_token_id) == (0, 1, 3)


def test_qwen2_arch_and_bad_arch(tok):
    model = build_tiny_model(tok, arch="qwen2", hidden_size=32, num_heads=2)
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.config.hidden_size == 32
    with pytest.raises(ValueError, match="arch 'gpt9'"):
        build_tiny_model(tok, arch="gpt9")


@pytest.mark.parametrize("arch, cls", [("qwen3", "Qwen3ForCausalLM"), ("mistral", "MistralForCausalLM")])
def test_qwen3_and_mistral_archs_keep_hidden_over_heads(tok, arch, cls):
    model = build_tiny_model(tok, arch=arch, hidden_size=32, num_heads=2)
    assert type(model).__name__ == cls and model.model.layers[0].self_attn.q_proj.out_features == 32


def test_save_tiny_loads_through_auto_classes(tmp_path, tok):
    save_tiny(tmp_path, seed=3)
    loaded_tok = AutoTokenizer.from_pretrained(tmp_path)
    text = "user : add 1 2 assistant :"
    assert loaded_tok(text)["input_ids"] == tok(text)["input_ids"]
    assert loaded_tok.apply_chat_template([{"role": "user", "content": "a"}], add_generation_prompt=True,
                                          tokenize=False) == "user : a assistant :"
    assert loaded_tok.pad_token == "<pad>" and loaded_tok.padding_side == "left"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    reference = build_tiny_model(tok, seed=3)
    for (k, va), vb in zip(reference.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(va, vb), k
