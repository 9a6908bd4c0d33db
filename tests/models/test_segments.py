"""Packed-row attention as padded segments (models/segments.py), the native forward's CPU default."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fleetrl.models import segments
from fleetrl.models.decoder import packed_mask

# One doc: prompt p0 p1 (rows 0-1, segment 0), response A = a0 a1 (rows 2-3), response B = b0 (row 4); then a
# 1-token pad doc (row 5).
DOC, SEG = torch.tensor([0, 0, 0, 0, 0, 1]), torch.tensor([0, 0, 1, 1, 2, 0])


def test_build_by_hand():
    pad = segments.build(DOC, SEG)
    # Segments: prompt (q 0-1, keys 0-1), A (q 2-3, keys 0 1 2 3), B (q 4, keys 0 1 4), pad (q 5, keys 5).
    # Lq = 2, Lk = 4; pad slots read row 0.
    assert pad.q_index_SL.tolist() == [[0, 1], [2, 3], [4, 0], [5, 0]]
    assert pad.k_index_SK.tolist() == [[0, 1, 0, 0], [0, 1, 2, 3], [0, 1, 4, 0], [5, 0, 0, 0]]
    allowed = pad.allowed_S1LK[:, 0].int().tolist()
    assert allowed[0] == [[1, 0, 0, 0], [1, 1, 0, 0]]  # the prompt: causal over itself
    assert allowed[1] == [[1, 1, 1, 0], [1, 1, 1, 1]]  # a0 sees p0 p1 a0; a1 also a1 (bottom-right causal)
    assert allowed[2] == [[1, 1, 1, 0], [1, 0, 0, 0]]  # b0 sees p0 p1 b0; the pad query sees key 0 only
    assert allowed[3] == [[1, 0, 0, 0], [1, 0, 0, 0]]
    assert pad.out_index_N.tolist() == [0, 1, 2, 3, 4, 6]  # slot s * Lq + i of each row


def test_attend_equals_sdpa_with_the_dense_mask_values_and_gradients():
    # Two shared-prompt docs (prompt 5 + responses 3, 1, 4; prompt 2 + responses 6, 2) and a 3-token pad doc.
    lens = [(0, 0, 5), (0, 1, 3), (0, 2, 1), (0, 3, 4), (1, 0, 2), (1, 4, 6), (1, 5, 2), (2, 0, 3)]
    doc = torch.cat([torch.full((n,), d) for d, _, n in lens])
    seg = torch.cat([torch.full((n,), s) for _, s, n in lens])
    N, H, G, Q = doc.shape[0], 6, 2, 8
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, N, Q, generator=g, dtype=torch.float64, requires_grad=True) for h in (H, G, G))
    grad_out = torch.randn(1, H, N, Q, generator=g, dtype=torch.float64)
    dense = packed_mask(doc, seg, "dense")
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(H // G, 1), v.repeat_interleave(H // G, 1),
                                          attn_mask=dense)
    padded = packed_mask(doc, seg, "segments")
    assert isinstance(padded, segments.PaddedSegments)
    got = segments.attend(q, k, v, padded)
    torch.testing.assert_close(got, want)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), grad_out), torch.autograd.grad(want, (q, k, v), grad_out)):
        torch.testing.assert_close(a, b)


def test_bf16_scores_are_fp32_like_the_flash_kernel():
    # bf16 inputs: the padded path must be as close to an fp32 reference as CPU SDPA's own bf16 kernel is.
    doc = torch.zeros(110, dtype=torch.long)
    seg = torch.tensor([0] * 20 + [1] * 30 + [2] * 30 + [3] * 30)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4, 110, 64, generator=g) * 3 for _ in range(3))
    dense = packed_mask(doc, seg, "dense")
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    sdpa_err = (F.scaled_dot_product_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), attn_mask=dense).float()
                - ref).abs().max()
    ours_err = (segments.attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), segments.build(doc, seg)).float()
                - ref).abs().max()
    assert ours_err <= 1.5 * sdpa_err


def test_a_row_that_padding_would_inflate_keeps_the_dense_mask():
    # One 40-token sample among 30 one-token samples: 31 segments x 40 x 40 slots > 70 x 70 dense cells.
    doc = torch.cat([torch.zeros(40, dtype=torch.long), torch.arange(1, 31)])
    seg = torch.zeros(70, dtype=torch.long)
    assert segments.build(doc, seg) is None
    mask = packed_mask(doc, seg, "segments")
    assert isinstance(mask, torch.Tensor) and mask.shape == (1, 1, 70, 70)
