"""Packed-row attention as varlen segments (models/varlen.py): the segments by hand, and the CPU reference against
the dense mask it replaces."""
import pytest
import torch

from fleetrl.models import varlen
from fleetrl.models.decoder import packed_mask


def test_segments_of_a_shared_prompt_row_by_hand():
    # Doc 0: prompt (0, 1), response A (2, 3), response B (4); doc 1: prompt (5), response (6); pad doc 2: (7).
    doc = torch.tensor([0, 0, 0, 0, 0, 1, 1, 2])
    seg = torch.tensor([0, 0, 1, 1, 2, 0, 3, 0])
    s = varlen.segments(doc, seg)
    # Runs P0, A, B, P1, R, pad.
    assert s.q_cu.tolist() == [0, 2, 4, 5, 6, 7, 8]
    assert s.k_cu.tolist() == [0, 2, 6, 9, 10, 12, 13]  # keys: 2, 2+2, 2+1, 1, 1+1, 1
    assert s.kv_index.tolist() == [0, 1, 0, 1, 2, 3, 0, 1, 4, 5, 5, 6, 7]
    assert (s.max_q, s.max_k) == (2, 4) and s.q_cu.dtype == torch.int32


def test_reference_attention_equals_the_dense_mask():
    g = torch.Generator().manual_seed(0)
    doc = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1, 1, 2, 2])
    seg = torch.tensor([0, 0, 0, 4, 4, 5, 0, 6, 6, 0, 0])
    q = torch.randn(1, 4, 11, 8, generator=g)  # 4 query heads over 2 KV heads
    k, v = torch.randn(1, 2, 11, 8, generator=g), torch.randn(1, 2, 11, 8, generator=g)
    got = varlen.attend(q, k, v, varlen.segments(doc, seg))
    mask = packed_mask(doc, seg)
    want = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                            attn_mask=mask)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_pow2_bounds():
    assert [varlen._pow2(n) for n in (1, 2, 3, 128, 129)] == [1, 2, 4, 128, 256]


@pytest.mark.gpu
def test_flash_varlen_kernel_equals_the_reference_forward_and_backward():
    # bf16 on the GPU, shared-prompt segments of uneven lengths (queries shorter than keys: the bottom-right causal
    # alignment), 14 query heads over 2 KV heads as Qwen2.5-0.5B.
    g = torch.Generator().manual_seed(0)
    lens = [(0, 37), (1, 90), (2, 5), (0, 1), (3, 64), (0, 130), (4, 200), (5, 77)]  # (seg, length) runs, 3 docs
    docs = [0, 0, 0, 1, 1, 2, 2, 2]
    doc = torch.cat([torch.full((n,), d) for d, (_, n) in zip(docs, lens)]).cuda()
    seg = torch.cat([torch.full((n,), s) for s, n in lens]).cuda()
    N = doc.shape[0]
    q = torch.randn(1, 14, N, 64, generator=g).cuda().bfloat16().requires_grad_()
    k = torch.randn(1, 2, N, 64, generator=g).cuda().bfloat16().requires_grad_()
    v = torch.randn(1, 2, N, 64, generator=g).cuda().bfloat16().requires_grad_()
    segs = varlen.segments(doc, seg)
    grad = torch.randn(1, 14, N, 64, generator=g).cuda().bfloat16()
    out = {}
    for name, fn in (("kernel", varlen._kernel), ("reference", varlen._reference)):
        q.grad = k.grad = v.grad = None
        q_NHQ = q[0].transpose(0, 1)
        k_KGQ, v_KGQ = (t[0].transpose(0, 1).index_select(0, segs.kv_index) for t in (k, v))
        o = fn(q_NHQ, k_KGQ, v_KGQ, segs)
        o.transpose(0, 1)[None].backward(grad)
        out[name] = [o.float(), q.grad.float(), k.grad.float(), v.grad.float()]
    for a, b in zip(out["kernel"], out["reference"]):
        torch.testing.assert_close(a, b, atol=3e-2, rtol=3e-2)


def test_a_floor_fixes_the_length_bounds_unless_a_segment_exceeds_it():
    doc, seg = torch.tensor([0, 0, 0, 0, 0]), torch.tensor([0, 0, 1, 1, 1])  # prompt 2, response 3 (keys 5)
    s = varlen.segments(doc, seg, floor=512)
    assert (s.max_q, s.max_k) == (512, 512)
    s = varlen.segments(doc, seg, floor=4)
    assert (s.max_q, s.max_k) == (4, 8)  # keys 5 > 4: raised to their power of two
    s = varlen.segments(doc, seg, floor=5)
    assert (s.max_q, s.max_k) == (5, 5)  # keys 5 fit under a floor that is no power of two: it stays


def _shared_rows(groups: list[list[int]], prompt: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """doc / seg ids of a shared-prompt row: one doc per group, its prompt then its responses of these lengths."""
    doc, seg, next_seg = [], [], 1
    for d, responses in enumerate(groups):
        doc += [d] * (prompt + sum(responses))
        seg += [0] * prompt
        for n in responses:
            seg += [next_seg] * n
            next_seg += 1
    return torch.tensor(doc), torch.tensor(seg)


def test_micro_batches_with_new_segment_counts_reuse_one_compiled_graph():
    # A long-tailed run's micro-batches have 8 to 128 segments (H200 log, ninth round); a compiled layer that took
    # their sizes as constants recompiled for each. The segment tensors are marked dynamic, so one graph serves all.
    from torch._dynamo.testing import CompileCounter

    def uses_segments(x: torch.Tensor, s: varlen.VarlenSegments) -> torch.Tensor:
        return x.index_select(0, s.kv_index).sum() + (s.q_cu.float().sum() + s.k_cu.float().sum()) * s.max_k

    torch._dynamo.reset()
    counter = CompileCounter()
    # dynamic=False as on the GPU (without its duck-sizing wrapper; the GPU test below runs the real layer)
    fn = torch.compile(uses_segments, backend=counter, fullgraph=True, dynamic=False)
    for groups in ([[2, 5]], [[1, 1, 4], [3]], [[2, 2], [1, 6, 1], [5, 5, 5, 1]]):
        doc, seg = _shared_rows(groups)
        s = varlen.segments(doc, seg, floor=64)
        x = torch.randn(64, 2)  # the row, one length here: only the segment counts change
        assert fn(x, s) == uses_segments(x, s)
    assert counter.frame_count == 1
    torch._dynamo.reset()


@pytest.mark.gpu
def test_compiled_native_layer_with_varlen_segments_compiles_once_for_any_row():
    # The real layer (models/decoder.py) on the GPU: rows of 128, 256 and 128 tokens (a varlen row is rounded to
    # PACK_ALIGN, packing.py) whose segment and key counts differ.
    from torch._dynamo.utils import counters

    from fleetrl.models.decoder import NativeDecoder

    cfg = __import__("transformers").Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128,
                                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    model = __import__("transformers").Qwen2ForCausalLM(cfg).cuda().bfloat16()
    torch._dynamo.reset()
    counters.clear()
    decoder = NativeDecoder(model, compile_backend="inductor")
    for groups in ([[20, 40, 4]], [[10, 10, 10, 10], [5, 15], [90, 60]], [[1] * 30, [2] * 16]):
        doc, seg = _shared_rows(groups, prompt=8)
        n = -(-doc.shape[0] // 128) * 128
        pad = n - doc.shape[0]
        doc = torch.cat([doc, torch.full((pad,), int(doc.max()) + 1)]).cuda()
        seg = torch.cat([seg, torch.zeros(pad, dtype=torch.long)]).cuda()
        ids = torch.randint(0, 64, (1, n), device="cuda")
        positions = torch.arange(n, device="cuda")[None]  # the values do not matter for the compile count
        decoder.hidden(model, ids, positions, packed_mask(doc, seg, "varlen", 256)).float().sum().backward()
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()
