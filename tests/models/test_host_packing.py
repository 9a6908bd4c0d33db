"""Packed rows built on the host and queued to the device (models/packing.py `Packed.to`, models/native.py `host=`),
and the scatter by index that replaced masked_scatter: the same numbers, and on a GPU no host wait in a
micro-batch's forward and backward."""
from __future__ import annotations

import pytest
import torch
import transformers

from fleetrl.models import varlen
from fleetrl.models.decoder import NativeDecoder
from fleetrl.models.native import packed_native_logprobs, padded_native_logprobs
from fleetrl.models.packing import HostRows, pack, unpack_tokens
from tests.models.test_native_forward import BATCH, V, _batch


def test_response_index_lists_the_response_cells_row_major():
    # BATCH's responses have 7, 1, 4 and 2 real tokens in rows of R = 7: cells 0-6, 7, 14-17, 21-22.
    pk = pack(*_batch(*BATCH))
    assert pk.response_index_M.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 14, 15, 16, 17, 21, 22]


def test_unpack_by_index_equals_masked_scatter_values_and_gradient():
    keep = torch.tensor([[True, False, True], [False, True, True]])
    x = torch.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)
    by_index = unpack_tokens(x, keep, torch.tensor([0, 2, 4, 5]))
    assert by_index.tolist() == [[1.0, 0.0, 2.0], [0.0, 3.0, 4.0]]
    (by_index * torch.tensor([[5.0, 6.0, 7.0], [8.0, 9.0, 10.0]])).sum().backward()
    assert x.grad.tolist() == [5.0, 7.0, 9.0, 10.0]  # the weights at the kept cells, in order
    torch.testing.assert_close(by_index, unpack_tokens(x, keep))


def test_every_copy_of_varlen_segments_is_marked_dynamic():
    # A compiled layer takes a tensor's size as a constant unless that tensor itself is marked, so the copy a
    # move makes must be marked too; fresh clones stand in for the device copies here.
    s = varlen.segments(torch.tensor([0, 0, 0, 1, 1]), torch.tensor([0, 0, 1, 0, 2]))
    copy = varlen.VarlenSegments(s.q_cu.clone(), s.k_cu.clone(), s.kv_index.clone(), s.max_q, s.max_k)
    for t, src in zip((copy.q_cu, copy.k_cu, copy.kv_index), (s.q_cu, s.k_cu, s.kv_index)):
        assert t is not src and t.tolist() == src.tolist()
        assert 0 in getattr(t, "_dynamo_dynamic_indices", set())  # what torch._dynamo.mark_dynamic records


@pytest.mark.gpu
@pytest.mark.parametrize("attention, share", [("varlen", True), ("dense", False), ("flex", False),
                                               ("padded", False)])
def test_host_built_row_equals_device_built_and_never_waits_for_the_gpu(attention, share):
    # The compiled GPU layer over a packed row built on the host gives the device-built row's log-probs and
    # gradients; and once compiled, a micro-batch's forward + backward on the host-built row runs under CUDA's
    # sync debug mode "error", which raises at the first host read of device memory.
    # head_dim 16: flex attention's kernel needs at least 16; the flash varlen kernel takes bf16 / fp16 only
    cfg = transformers.Qwen2Config(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=96, max_position_embeddings=64,
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg).cuda().bfloat16()
    host = HostRows(*_batch([6, 2, 6, 6, 3], [7, 5, 3, 1, 7]))
    if share:  # rows 2-3 take row 0's prompt; neighbours only share, so rows 2-3 hold one copy between them
        for t in host[:2]:
            t[2:4] = t[0]
    dev = tuple(t.cuda() for t in host)
    decoder = NativeDecoder(model, compile_backend="inductor")
    kw = dict(temperature=0.9, return_entropy=True)
    if attention == "padded":  # compacted rows and the fused head pass (its index comes from the host copy)
        fn, kw = padded_native_logprobs, dict(kw, fused_chunk=16)
    else:
        fn, kw = packed_native_logprobs, dict(kw, attention=attention, share_prompts=share, max_segment=32)

    def loss_and_grads(**extra):
        model.zero_grad()
        lp, ent = fn(decoder, model, *dev, **kw, **extra)
        (lp.sum() - ent.sum()).backward()
        return lp.detach(), [p.grad.clone() for p in model.parameters()]

    want = loss_and_grads()
    got = loss_and_grads(host=host)
    torch.testing.assert_close(got[0], want[0])
    for a, b in zip(got[1], want[1]):  # flash's backward adds dQ atomically: the order of bf16 sums may differ
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1.6e-2)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss_and_grads(host=host)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch._dynamo.reset()

