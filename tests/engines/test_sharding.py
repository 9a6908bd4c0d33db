"""FSDP2 around our own forwards (engines/sharding.py): the native decoder's packed log-probs and their gradients
are the same on a sharded model as on a plain copy, in one process (a 1-rank group: FSDP2's hooks, its
gather and its gradient reduce all run). The two-process runs through the trainer are
tests/integration/test_dp.py."""
from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Iterator

import pytest
import torch
import torch.distributed as dist
import transformers

from fleetrl.config.schema import LoraConfig
from fleetrl.engines.sharding import gathered_call, shard
from fleetrl.engines.training import _decoder_layers
from fleetrl.models.decoder import NativeDecoder
from fleetrl.models.lora import apply_lora
from fleetrl.models.native import NativeForward
from fleetrl.models.packing import PackedForward


def test_gathered_call_on_an_unsharded_module_is_a_plain_call():
    lin = torch.nn.Linear(2, 2)
    assert gathered_call(lin, lambda a, b=0: a + b, 1, b=2) == 3


@contextmanager
def _one_rank_group(backend: str) -> Iterator[None]:
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _rows(device: str) -> tuple[torch.Tensor, ...]:
    """Two prompts × two samples, left-padded prompts and right-padded responses of uneven lengths."""
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, 60, (4, 6), generator=g)
    prompt_mask = torch.tensor([[0, 0, 1, 1, 1, 1]] * 2 + [[1] * 6] * 2)
    prompts[2:] = prompts[2]
    prompts[:2] = prompts[0]
    responses = torch.randint(1, 60, (4, 5), generator=g)
    response_mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]])
    return tuple(t.to(device) for t in (prompts, prompt_mask, responses * response_mask, response_mask))


def _logprobs_and_grads(model: torch.nn.Module, compile_backend: str | None, attention: str,
                        rows: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    packed = PackedForward(max_tokens=64, attention=attention, share_prompts=True, max_segment=16)
    forward = NativeForward(NativeDecoder(model, compile_backend=compile_backend), packed=packed)
    for _ in range(2):  # the second pass reuses the gathered buffers and any compiled graph
        model.zero_grad(set_to_none=True)
        logp, _ = gathered_call(model, forward, model, *rows, temperature=1.0, return_entropy=False)
        (logp.float() * rows[3]).sum().backward()
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).float()
             for n, p in model.named_parameters() if p.requires_grad}
    return logp.detach().float(), grads


def _check_sharded_equals_plain(device: str, backend: str, compile_backend: str | None, attention: str,
                                dtype: torch.dtype, tol: float, lora: bool) -> None:
    cfg = transformers.Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    plain = transformers.Qwen2ForCausalLM(cfg).to(device, dtype)
    if lora:  # frozen base and trainable adapters in one FSDP2 group per layer
        apply_lora(plain, LoraConfig(rank=4, alpha=8.0))
        for name, p in plain.named_parameters():
            if "lora_B" in name:  # B starts at 0, which would leave A without a gradient
                torch.nn.init.normal_(p, std=0.1)
    sharded = copy.deepcopy(plain)
    rows = _rows(device)
    want_logp, want_grads = _logprobs_and_grads(plain, compile_backend, attention, rows)
    with _one_rank_group(backend):
        shard(sharded, _decoder_layers(sharded))
        assert all(hasattr(p, "to_local") for p in sharded.parameters()), "every parameter is an FSDP2 DTensor"
        got_logp, got_grads = _logprobs_and_grads(sharded, compile_backend, attention, rows)
    torch.testing.assert_close(got_logp, want_logp, atol=tol, rtol=tol)
    assert set(got_grads) == set(want_grads)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=tol, rtol=tol, msg=lambda m, n=name: f"{n}: {m}")
    root = "model.embed_tokens.weight" if not lora else "model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert want_grads[root].abs().sum() > 0, "the gradient reached the root (tied head) or the adapters"


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_sharded_native_packed_forward_equals_the_plain_model_on_cpu(lora):
    _check_sharded_equals_plain("cpu", "gloo", None, "segments", torch.float32, 1e-6, lora)


@pytest.mark.gpu
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_sharded_compiled_native_varlen_forward_equals_the_plain_model_on_gpu(lora):
    # The GPU path of a sharded 7B run: NCCL, the compiled layer (static shapes), varlen attention, bf16.
    _check_sharded_equals_plain("cuda", "nccl", "inductor", "varlen", torch.bfloat16, 2e-2, lora)

