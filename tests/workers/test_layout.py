"""The update layout (workers/layout.py): which rows each rank gets, the global counts, the cuts back."""
from __future__ import annotations

import torch

from fleetrl.batch import Batch
from fleetrl.workers.layout import arrange_update, micro_batches, order_for_dp, rank_minis
from fleetrl.workers.messages import MiniBatchCounts

# Response lengths of the 8 samples; every prompt is 1 token, so a sample's token count is 1 + its length.
LENGTHS = [1, 2, 3, 4, 4, 4, 4, 1]


def _batch() -> Batch:
    resp_mask = torch.tensor([[1] * n + [0] * (4 - n) for n in LENGTHS])
    return Batch({"prompts": torch.full((8, 1), 7), "prompt_mask": torch.ones(8, 1, dtype=torch.long),
                  "responses": resp_mask * 5, "response_mask": resp_mask, "sid": torch.arange(8)})


def test_arrange_update_splits_each_mini_batch_over_ranks_in_order():
    # Mini-batch 0 = samples 0-3, token counts [2, 3, 4, 5]. The LPT greedy (largest first, least-loaded rank,
    # 2 rows per rank) puts 3 (5) on rank 0, 2 (4) on rank 1, 1 (3) on rank 1 (load 4 < 5), 0 (2) on rank 0:
    # rank 0 = {0, 3} (7 tokens), rank 1 = {1, 2} (7 tokens).
    # Mini-batch 1 = samples 4-7, counts [5, 5, 5, 2]: 4 -> r0, 5 -> r1, 6 -> r0 (tie 5/5, lower rank), 7 -> r1:
    # rank 0 = {4, 6}, rank 1 = {5, 7}.
    parts, counts = arrange_update(_batch(), num_mini=2, world=2, norm_len=4.0)
    assert [p["sid"].tolist() for p in parts] == [[0, 3, 4, 6], [1, 2, 5, 7]]
    # Global response tokens: mini 0 = 1+2+3+4 = 10, mini 1 = 4+4+4+1 = 13; 4 sequences each.
    assert counts == (MiniBatchCounts(num_tokens=10.0, num_seqs=4.0, norm_len=4.0),
                      MiniBatchCounts(num_tokens=13.0, num_seqs=4.0, norm_len=4.0))


def test_order_for_dp_returns_the_rows_each_rank_holds():
    parts, index = order_for_dp(_batch(), num_mini=2, world=2)
    assert [ix.tolist() for ix in index] == [[0, 3, 4, 6], [1, 2, 5, 7]]
    for p, ix in zip(parts, index):
        assert p["sid"].tolist() == ix.tolist()


def test_rank_minis_cuts_a_rank_batch_back_into_its_mini_batch_shares():
    parts, _ = arrange_update(_batch(), num_mini=2, world=2, norm_len=4.0)
    assert [m["sid"].tolist() for m in rank_minis(parts[1], 2)] == [[1, 2], [5, 7]]
    # One rank (world 1): the mini-batches are the contiguous halves.
    [whole], counts = arrange_update(_batch(), num_mini=2, world=1, norm_len=4.0)
    assert [m["sid"].tolist() for m in rank_minis(whole, 2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [c.num_tokens for c in counts] == [10.0, 13.0]


def test_micro_batches_are_consecutive_with_a_short_last_one():
    # 8 rows in micro-batches of 3: rows 0-2, 3-5, 6-7.
    mbs = micro_batches(_batch(), 3)
    assert [m["sid"].tolist() for m in mbs] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    # Each keeps only the response columns some row uses: longest lengths 3, 4, 4.
    assert [m["responses"].shape[1] for m in mbs] == [3, 4, 4]
    assert all(m.meta["full_response_len"] == 4 for m in mbs)
