import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from fleetrl.models.hf import load_causal_lm, load_tokenizer
from fleetrl.models.tiny import build_tiny_model, build_tiny_tokenizer, save_tiny


def _same_weights(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_tiny_spec_builds_seeded_model():
    model = load_causal_lm("tiny:")
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.hidden_size == 64
    assert _same_weights(model, load_causal_lm("tiny:"))  # every role loading "tiny:" starts from the same init
    small = load_causal_lm("tiny:hidden=32, layers=1,heads=2,seed=7,arch=qwen2")
    assert type(small).__name__ == "Qwen2ForCausalLM"
    assert (small.config.hidden_size, small.config.num_hidden_layers, small.config.num_attention_heads) == (32, 1, 2)
    assert _same_weights(small, build_tiny_model(build_tiny_tokenizer(), hidden_size=32, num_layers=1,
                                                 num_heads=2, seed=7, arch="qwen2"))
    assert load_causal_lm("tiny:", dtype="bfloat16").dtype == torch.bfloat16
    assert load_tokenizer("tiny:layers=1").eos_token == "<eos>"


@pytest.mark.parametrize("spec, match", [("tiny:width=3", "width=3"), ("tiny:hidden", "key=value"),
                                         ("tiny:layers=two", "not a int")])
def test_bad_tiny_spec(spec, match):
    with pytest.raises(ValueError, match=match):
        load_causal_lm(spec)


def test_bad_dtype():
    with pytest.raises(ValueError, match="dtype 'float8'"):
        load_causal_lm("tiny:", dtype="float8")


def test_missing_local_path_is_a_clear_error(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ValueError, match="does not exist") as err:
        load_causal_lm(missing)
    assert missing in str(err.value) and "tiny:" in str(err.value)
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer("./checkpoints/step_10")


def test_folder_without_model_is_wrapped(tmp_path):
    with pytest.raises(ValueError, match="could not load a causal LM") as err:
        load_causal_lm(str(tmp_path))
    assert str(tmp_path) in str(err.value)


def test_saved_folder_loads(tmp_path):
    save_tiny(tmp_path, seed=2)
    model, tok = load_causal_lm(str(tmp_path)), load_tokenizer(str(tmp_path))
    assert _same_weights(model, build_tiny_model(build_tiny_tokenizer(), seed=2)) and not model.training
    assert tok.pad_token_id == 0 and tok.padding_side == "left"


def _mapped_paths() -> set[str]:
    return {line.split(maxsplit=5)[5].strip() for line in Path("/proc/self/maps").read_text().splitlines()
            if len(line.split(maxsplit=5)) == 6}


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads Linux's /proc/self/maps")
def test_a_cpu_load_keeps_no_mapping_of_the_checkpoint_file(tmp_path):
    """Our contract: once loaded on the CPU, the model's tensors own their memory, so the checkpoint file is not
    mapped into the process (a mapping keeps every page ever read resident, bench/RESULTS.md "RSS over a whole
    run"); the tied head stays tied and the weights are the saved ones."""
    tied = build_tiny_model(build_tiny_tokenizer(), seed=3)
    tied.config.tie_word_embeddings = True
    tied.lm_head.weight = tied.model.embed_tokens.weight
    tied.save_pretrained(tmp_path)
    build_tiny_tokenizer().save_pretrained(tmp_path)
    model = load_causal_lm(str(tmp_path))
    assert not {p for p in _mapped_paths() if p.startswith(str(tmp_path))}
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert _same_weights(model, tied)


def test_missing_pad_token_falls_back_to_eos(tmp_path):
    tok = build_tiny_tokenizer()
    tok.pad_token = None
    tok.padding_side = "right"
    tok.save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    assert loaded.pad_token == "<eos>" and loaded.pad_token_id == 1 and loaded.padding_side == "left"


def test_gguf_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no file at"):
        load_causal_lm(f"gguf:{tmp_path / 'model.gguf'}")


needs_gguf = pytest.mark.skipif(
    importlib.util.find_spec("gguf") is None or importlib.util.find_spec("accelerate") is None,
    reason="GGUF loading needs the `gguf` and `accelerate` packages (pip install 'fleetrl[gguf]')")


@needs_gguf
def test_gguf_file_loads_same_logits(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEETRL_CACHE_DIR", str(tmp_path / "cache"))  # GGUF loads are cached: keep this file's here
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, seed=4)
    path = _write_llama_gguf(model, tok, tmp_path / "tiny.gguf")
    loaded = load_causal_lm(f"gguf:{path}")
    same = load_causal_lm(str(tmp_path), gguf_file="tiny.gguf")
    ids = torch.tensor([[49, 48, 40, 14, 15, 50, 48]])
    with torch.no_grad():
        expected = model(ids).logits
        assert torch.allclose(loaded(ids).logits, expected, atol=1e-5)
        assert torch.allclose(same(ids).logits, expected, atol=1e-5)
    assert loaded.config.eos_token_id == 1


def _write_llama_gguf(model, tokenizer, path: Path) -> Path:
    """The tiny Llama as a float32 GGUF file laid out as llama.cpp's converter does (model part only)."""
    import gguf

    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    for key, tensor in model.state_dict().items():
        base, suffix = key.rsplit(".", 1)
        name = f"{names.get_name(base)}.{suffix}"
        array = tensor.numpy()
        # llama.cpp interleaves the two rotary halves of q/k rows per head; transformers undoes it on load.
        heads = {".attn_q.": cfg.num_attention_heads, ".attn_k.": cfg.num_key_value_heads}
        for tag, n_head in heads.items():
            if tag in name:
                array = array.reshape(n_head, 2, -1, array.shape[-1]).swapaxes(1, 2).reshape(array.shape)
        writer.add_tensor(name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_without_package_names_the_install(tmp_path, monkeypatch):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    monkeypatch.setitem(__import__("sys").modules, "gguf", None)  # makes `import gguf` raise ImportError
    with pytest.raises(ValueError, match="pip install gguf"):
        load_causal_lm(f"gguf:{path}")


def test_parameter_count_is_the_loaded_models_without_reading_weights(tmp_path):
    from fleetrl.models.hf import parameter_count

    def numel(model) -> int:
        return sum(p.numel() for p in model.parameters())

    folder = save_tiny(tmp_path / "m", hidden_size=32, num_layers=3, arch="qwen2")
    assert parameter_count(str(folder)) == numel(load_causal_lm(str(folder)))
    assert parameter_count("tiny:hidden=32,layers=1") == numel(load_causal_lm("tiny:hidden=32,layers=1"))
    assert parameter_count("random:qwen2.5-test") == numel(load_causal_lm("random:qwen2.5-test"))
    assert parameter_count("some-org/some-model") is None  # not on this machine: the caller's default applies
