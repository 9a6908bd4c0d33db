"""FastRolloutEngine on Qwen3 and Mistral, CPU fp32: exact against HF generate / a training forward, with the fused
and norm-folded projections (fused.py), and the sliding-window refusals (arch.read_spec, arch.check_window).

Qwen3 differs from the Llama/Qwen2 tests (test_fast.py) by its per-head q_norm / k_norm before RoPE, a head_dim that
is not hidden / heads, o_proj and q/k/v biases under attention_bias, and a tied head; Mistral by its sliding window."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM, Qwen3Config, Qwen3ForCausalLM

from fleetrl.engines.fast import FastRolloutEngine
from fleetrl.engines.fast.arch import model_weights
from fleetrl.engines.fast.forward import DecoderForward
from fleetrl.engines.protocol import FINISH_LENGTH, SamplingParams
from tests.engines.test_fast import SHAPE, CharTokenizer, expected_mask, hf_greedy, left_padded, training_logprobs

ARCHS = ["qwen3", "qwen3_bias_tied", "mistral"]


def family_model(arch: str, eos: int | None = None, **config: object) -> torch.nn.Module:
    """A tiny random Qwen3 or Mistral with every weight that the forward must apply drawn away from HF's init (norm
    weights of ones, zero biases). Qwen3: head_dim 32 over hidden 64 and 4 heads (q is 128 wide, not 64).
    `config`: fields to change."""
    torch.manual_seed(0)
    if arch.startswith("qwen3"):
        extra = dict(attention_bias=True, tie_word_embeddings=True) if arch == "qwen3_bias_tied" else {}
        cfg = Qwen3Config(**{**SHAPE, "head_dim": 32, "rope_theta": 5000.0, **extra, **config}, eos_token_id=eos)
        model = Qwen3ForCausalLM(cfg)
    else:
        cfg = MistralConfig(**{**SHAPE, "rope_theta": 5000.0, "sliding_window": 4096, **config}, eos_token_id=eos)
        model = MistralForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # layer norms and Qwen3's q_norm / k_norm
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0, 0.5)
    model.generation_config.eos_token_id = eos
    return model.eval()


def engine(model: torch.nn.Module, eos: int | None = None, **kw) -> FastRolloutEngine:
    return FastRolloutEngine(model, CharTokenizer(eos), **{"device": "cpu", "max_seq_len": 64, **kw})


def test_the_models_have_what_the_tests_claim() -> None:
    qwen3 = family_model("qwen3_bias_tied")
    att = qwen3.model.layers[0].self_attn
    assert att.q_proj.out_features == 4 * 32 != qwen3.config.hidden_size and att.o_proj.bias is not None
    assert qwen3.lm_head.weight is qwen3.model.embed_tokens.weight
    assert float((att.q_norm.weight.detach() - 1).abs().max()) > 0.1
    spec = engine(qwen3).spec
    assert spec.qk_norm and spec.head_dim == 32 and spec.attention_window is None
    mistral = engine(family_model("mistral")).spec
    assert not mistral.qk_norm and mistral.attention_window == 4096 and mistral.group == 2


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hf_generate(arch: str) -> None:
    ids, mask = left_padded([3, 9, 6, 1])
    probe = hf_greedy(family_model(arch), ids, mask, 12, None)
    eos = int(probe[0, 4])  # a token greedy really emits, so some rows stop early
    model = family_model(arch, eos)
    ref = hf_greedy(model, ids, mask, 12, eos)
    out = engine(model, eos).generate(ids, mask, SamplingParams(max_new_tokens=12, temperature=0.0))
    ref_mask = expected_mask(ref, eos)
    assert torch.equal(out.response_mask, ref_mask)
    assert torch.equal(out.responses, ref * ref_mask)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fuse", [False, True])
def test_sampled_logprobs_match_the_training_forward(arch: str, fuse: bool) -> None:
    model = family_model(arch)
    ids, mask = left_padded([5, 2, 8])
    out = engine(model, fuse_projections=fuse).generate(
        ids, mask, SamplingParams(max_new_tokens=16, temperature=0.7, seed=3))
    assert out.response_mask.all() and out.finish_reasons == [FINISH_LENGTH] * 3
    torch.testing.assert_close(out.logprobs, training_logprobs(model, ids, mask, out, 0.7), atol=1e-5, rtol=0)


def test_folded_norms_keep_the_per_head_norms_separate_and_exact() -> None:
    """fold_norms (the Triton decode's setting) folds ln1 into wqkv; q_norm / k_norm act on each head's output and
    stay in the weights as they are. A prefill and a decode step through the folded views give the plain logits."""
    model = family_model("qwen3_bias_tied")
    spec, plain = engine(model).spec, model_weights(model)
    folded = DecoderForward(model, spec, 16, torch.float32, torch.device("cpu"), kernels=None, fuse=True)
    folded.fused.fold_norms = True
    folded.refresh_fused()
    lw = folded.weights().layers[0]
    assert lw.ln1 is None  # the model's own norm tensors, read in place:
    assert lw.qn.data_ptr() == plain.layers[0].qn.data_ptr() and lw.kn.data_ptr() == plain.layers[0].kn.data_ptr()
    torch.testing.assert_close(lw.wqkv, torch.cat([plain.layers[0].wq, plain.layers[0].wk, plain.layers[0].wv])
                               * plain.layers[0].ln1[None, :], rtol=0, atol=0)
    tokens, logits = torch.tensor([[5, 9, 2, 7, 11, 3]]), []
    for fwd in (folded, DecoderForward(model, spec, 16, torch.float32, torch.device("cpu"), kernels=None)):
        k = torch.zeros(2, 1, 2, 16, 32)
        v = torch.zeros_like(k)
        pre = fwd.prefill(k, v, tokens, torch.tensor([6]), torch.tensor([0]))
        logits.append(torch.cat([pre, fwd.decode(k, v, torch.tensor([4]), torch.tensor([6]), 16)]))
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=1e-5)


def test_bf16_cast_copy_carries_the_per_head_norms() -> None:
    """An fp32 model decoded in bf16 (cast.py): q_norm / k_norm are cast with every other weight."""
    model = family_model("qwen3")
    eng = engine(model, compute_dtype=torch.bfloat16, keep_cast=True)
    ids, mask = left_padded([4, 7])
    out = eng.generate(ids, mask, SamplingParams(max_new_tokens=6, temperature=1.0, seed=5))
    # bf16 rounding only (~5e-3 here); skipping the q/k norms costs ~0.3 even in fp32
    assert float((out.logprobs - training_logprobs(model, ids, mask, out, 1.0)).abs().max()) < 0.05
    assert eng._fwd.shadow.layers[1].qn.dtype == torch.bfloat16
    assert torch.equal(eng._fwd.shadow.layers[1].qn, model.model.layers[1].self_attn.q_norm.weight.bfloat16())


def test_qwen3_sliding_window_layers_are_refused_by_name() -> None:
    model = family_model("qwen3", use_sliding_window=True, sliding_window=16, max_window_layers=1)
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    with pytest.raises(ValueError, match=r"use_sliding_window=True with max_window_layers=1 gives layers \[1\]"):
        engine(model)
    # the switch on with every layer below max_window_layers: HF attends fully, and so may the engine
    engine(family_model("qwen3", use_sliding_window=True, sliding_window=16, max_window_layers=2))


def test_mistral_window_shorter_than_max_seq_len_is_refused() -> None:
    with pytest.raises(ValueError, match=r"sliding_window=32 is shorter than the engine's max_seq_len=64"):
        engine(family_model("mistral", sliding_window=32))


def test_mistral_window_covering_max_seq_len_decodes_what_hf_decodes() -> None:
    """A window of exactly max_seq_len: HF masks keys more than 23 positions back, which no sequence here reaches, so
    its windowed attention is the engine's full attention (and longer requests are refused by max_seq_len)."""
    model = family_model("mistral", sliding_window=24)
    ids, mask = left_padded([3, 9, 6])
    out = engine(model, max_seq_len=24).generate(ids, mask, SamplingParams(max_new_tokens=15, temperature=0.0))
    assert torch.equal(out.responses, hf_greedy(model, ids, mask, 15, None))
    with pytest.raises(ValueError, match="max_seq_len=24"):
        engine(model, max_seq_len=24).generate(ids, mask, SamplingParams(max_new_tokens=16, temperature=0.0))


@pytest.mark.slow  # ~25 s on 2 cores: the interpreter runs each Triton program in numpy
def test_triton_decode_in_the_interpreter() -> None:
    """The Triton decode of these families (q/k norm in the attention kernel, folded or not) equals the torch
    decode, on CPU via TRITON_INTERPRET=1 (where triton is installed); the GPU tests below run it for real."""
    pytest.importorskip("triton")
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    script = Path(__file__).with_name("triton_families_check.py")
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr


# ---------------------------------------------------------------------------------------------- GPU (skipped on CPU)
@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fuse", [True, False])
def test_graphs_and_kernels_decode_what_hf_decodes(arch: str, fuse: bool) -> None:
    """CUDA graphs and the Triton decode (q/k norm inside the attention kernel; with fuse, the norms folded:
    forward.py `_decode_folded`) against HF greedy, fp32 with TF32 off, and the sampled log-probs against HF's."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ids, mask = left_padded([3, 9, 6, 1])
    model = family_model(arch)
    ref = hf_greedy(model, ids, mask, 12, None)
    eng = engine(model.cuda(), device="cuda", fuse_projections=fuse)
    assert eng.use_cuda_graphs and eng.kernels is not None
    out = eng.generate(ids.cuda(), mask.cuda(), SamplingParams(max_new_tokens=12, temperature=0.0))
    assert torch.equal(out.responses.cpu(), ref.cpu())
    out = eng.generate(ids.cuda(), mask.cuda(), SamplingParams(max_new_tokens=8, temperature=0.7, seed=3))
    ref_lp = training_logprobs(model, ids.cuda(), mask.cuda(), out, 0.7)
    torch.testing.assert_close(out.logprobs, ref_lp, atol=1e-4, rtol=0)


@pytest.mark.gpu
def test_bf16_graphs_decode_qwen3_with_a_128_head_dim() -> None:
    """Qwen3's published head dim (128, the attention kernel's tuned launch) in bf16 with the kept cast copy and the
    folded norms: the sampled log-probs stay within bf16 rounding of HF's fp32 forward."""
    model = family_model("qwen3", head_dim=128)
    ids, mask = left_padded([5, 2, 8])
    eng = engine(model.cuda(), device="cuda", compute_dtype=torch.bfloat16)
    out = eng.generate(ids.cuda(), mask.cuda(), SamplingParams(max_new_tokens=8, temperature=1.0, seed=5))
    ref = training_logprobs(model, ids.cuda(), mask.cuda(), out, 1.0)
    assert float((out.logprobs - ref).abs().max()) < 0.05  # the CPU bf16 torch path: ~5e-3
