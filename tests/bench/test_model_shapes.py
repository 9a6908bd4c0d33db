"""The benchmarks' published shapes of the Qwen3 and Mistral families (bench/common.py FAMILY_SHAPES) build as the
HF class of their family and are shapes the fast engine reads (built on the meta device: no weights drawn)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from bench.common import FAMILY_SHAPES, MODEL_SHAPES, model_config
from fleetrl.engines.fast.arch import check_window, read_spec

# Parameters of the published checkpoints (embeddings included; a tied head counted once), in billions.
PUBLISHED = {"qwen3-0.6b": (0.596, "Qwen3ForCausalLM"), "qwen3-8b": (8.191, "Qwen3ForCausalLM"),
             "mistral-7b": (7.242, "MistralForCausalLM")}


@pytest.mark.parametrize("name", list(FAMILY_SHAPES))
def test_family_shapes_build_their_class_with_the_published_size(name: str) -> None:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config(name))
    billions, cls = PUBLISHED[name]
    assert type(model).__name__ == cls
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 3) == billions
    spec = read_spec(model)
    assert spec.head_dim == 128 and spec.qk_norm == name.startswith("qwen3")
    check_window(spec, 2048, "max_seq_len")  # the engine's default length fits Mistral's 4096-token window


def test_qwen2_shapes_keep_their_settings() -> None:
    cfg = model_config("qwen2.5-0.5b")
    assert cfg.model_type == "qwen2" and cfg.rope_parameters["rope_theta"] == 1_000_000.0
    assert set(FAMILY_SHAPES) < set(MODEL_SHAPES)
