"""FastRolloutEngine(cache_budget_bytes=...) (rollout.gpu_memory_fraction): the KV cache gets the slots that fit the
budget, at most max_batch; a call with more samples than slots queues the rest and gives the same samples; a budget
below one slot is refused naming the sizes; the ranks of a TP engine take the smallest budget's slots."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fleetrl.engines.fast import FastRolloutEngine
from fleetrl.engines.protocol import SamplingParams
from tests.engines.test_fast import CharTokenizer, left_padded, tiny_model
from tests.engines.test_fast_tp import _on_two_ranks, _same

# The tiny shape: 2 layers x 2 KV heads x head_dim 16 (64 / 4 heads), keys and values, fp32, 64 positions a slot.
SLOT = 2 * 2 * 2 * 16 * 4 * 64  # 32,768 bytes


def _engine(model: torch.nn.Module, **kw) -> FastRolloutEngine:
    return FastRolloutEngine(model, CharTokenizer(None), device="cpu", max_seq_len=64, max_batch=8, **kw)


def test_the_budget_sets_the_slots_and_the_samples_do_not_change() -> None:
    model = tiny_model("llama")
    full, bounded = _engine(model), _engine(model, cache_budget_bytes=3 * SLOT + SLOT // 2)
    assert bounded.slot_bytes() == SLOT and bounded.max_batch == 3 and full.max_batch == 8
    assert bounded.cache_bytes() == 3 * SLOT
    assert _engine(model, cache_budget_bytes=100 * SLOT).max_batch == 8  # never above max_batch
    ids, mask = left_padded([5, 2, 8, 8, 3, 6, 7, 4])
    for params in (SamplingParams(max_new_tokens=10, temperature=0.0),
                   SamplingParams(max_new_tokens=10, temperature=1.0, seed=3)):
        _same(full.generate(ids, mask, params), bounded.generate(ids, mask, params))
    assert bounded._buf.slots <= 3


def test_a_budget_below_one_slot_is_refused_naming_the_sizes() -> None:
    with pytest.raises(ValueError, match=r"holds no slot of 64 positions .*rollout.gpu_memory_fraction"):
        _engine(tiny_model("llama"), cache_budget_bytes=SLOT - 1)


def _check_smallest_budget(rank: int) -> None:
    engine = _engine(tiny_model("llama"), tp_group=dist.group.WORLD, cache_budget_bytes=(2 + 3 * rank) * SLOT)
    # each rank caches 1 of the 2 KV heads: its slot is half the size, so rank 0's budget holds 4 slots, rank 1's 8 (max_batch)
    assert engine.slot_bytes() == SLOT // 2 and engine.max_batch == 4


@pytest.mark.slow
def test_a_tp_engine_takes_the_smallest_budgets_slots() -> None:
    _on_two_ranks(_check_smallest_budget)
