"""SlotBuffers' prefix-sharing bookkeeping (engines/fast/state.py), by hand: which slots read which leader's rows."""
from __future__ import annotations

import torch

from fleetrl.engines.fast.arch import DecoderSpec
from fleetrl.engines.fast.state import SlotBuffers


def _buffers(slots: int) -> SlotBuffers:
    spec = DecoderSpec(num_layers=1, hidden=8, num_heads=2, num_kv_heads=1, head_dim=4, vocab=10, rms_eps=1e-6)
    return SlotBuffers.allocate(spec, slots, 16, torch.float32, torch.device("cpu"))


def test_a_fresh_buffer_reads_own_rows() -> None:
    buf = _buffers(4)
    assert buf.lead.tolist() == [0, 1, 2, 3] and buf.shared.tolist() == [0, 0, 0, 0]


def test_release_points_the_followers_of_stopped_slots_back_to_themselves() -> None:
    buf = _buffers(6)
    # slots 0-2: one prompt of 5 tokens led by 0; slots 3-4: another of 7 led by 3; slot 5 alone
    buf.lead.copy_(torch.tensor([0, 0, 0, 3, 3, 5]))
    buf.shared.copy_(torch.tensor([5, 5, 5, 7, 7, 4]))
    buf.release(torch.tensor([0]))
    assert buf.lead.tolist() == [0, 1, 2, 3, 3, 5]
    assert buf.shared.tolist() == [0, 0, 0, 7, 7, 4]
    buf.release(torch.tensor([4, 5]))  # a follower stopping frees nobody else; a lone slot stops reading its own prefix
    assert buf.lead.tolist() == [0, 1, 2, 3, 3, 5]
    assert buf.shared.tolist() == [0, 0, 0, 7, 7, 0]
    buf.release(torch.tensor([3]))
    assert buf.lead.tolist() == [0, 1, 2, 3, 4, 5] and buf.shared.tolist() == [0] * 6
