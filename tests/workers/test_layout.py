"""The update layout (workers/layout.py): which rows each rank gets, the global counts, the cuts back."""
from __future__ import annotations

import pytest
import torch

from fleetrl.batch import Batch, GroupPartition
from fleetrl.workers.layout import arrange_update, micro_batches, pad_response, rank_minis
from fleetrl.workers.messages import MiniBatchCounts

# Response lengths of the 8 samples; every prompt is 1 token, so a sample's token count is 1 + its length. The
# samples form 4 GRPO groups of 2 (ids 0 0 1 1 2 2 3 3).
LENGTHS = [1, 2, 3, 4, 4, 4, 4, 1]


def _batch() -> Batch:
    resp_mask = torch.tensor([[1] * n + [0] * (4 - n) for n in LENGTHS])
    return Batch({"prompts": torch.full((8, 1), 7), "prompt_mask": torch.ones(8, 1, dtype=torch.long),
                  "responses": resp_mask * 5, "response_mask": resp_mask, "sid": torch.arange(8),
                  "group": torch.arange(4).repeat_interleave(2)})


def test_arrange_update_deals_whole_groups_of_each_mini_batch_over_ranks():
    # A group's tokens: its prompt once + its responses: g0 = 1+1+2 = 4, g1 = 1+3+4 = 8, g2 = 1+4+4 = 9,
    # g3 = 1+4+1 = 6. Mini-batch 0 = groups 0, 1: the LPT greedy puts g1 (8) on rank 0, g0 (4) on rank 1.
    # Mini-batch 1 = groups 2, 3: g2 (9) -> rank 0, g3 (6) -> rank 1.
    batch = _batch()
    parts, counts = arrange_update(batch, GroupPartition.of(batch, world=2, num_mini=2), norm_len=4.0)
    assert [p["sid"].tolist() for p in parts] == [[2, 3, 4, 5], [0, 1, 6, 7]]
    # Global response tokens: mini 0 = 1+2+3+4 = 10, mini 1 = 4+4+4+1 = 13; 4 sequences each.
    assert counts == (MiniBatchCounts(num_tokens=10.0, num_seqs=4.0, norm_len=4.0),
                      MiniBatchCounts(num_tokens=13.0, num_seqs=4.0, norm_len=4.0))


def test_a_group_is_never_split_and_mini_batches_are_the_same_groups_at_any_world():
    batch = _batch()
    for world, num_mini in ((1, 1), (2, 1), (4, 1), (1, 2), (2, 2)):
        part = GroupPartition.of(batch, world=world, num_mini=num_mini)
        held = [set(batch["group"][rows].tolist()) for rows in part.rows]
        assert sorted(g for h in held for g in h) == [0, 1, 2, 3]  # every group on exactly one rank
        for rows in part.rows:  # ... with all its samples
            for g in set(batch["group"][rows].tolist()):
                assert (batch["group"][rows] == g).sum() == 2
        for rows in part.rows:  # each rank's share of mini-batch m holds groups of mini-batch m only
            minis = [batch["group"][r].tolist() for r in rows.reshape(num_mini, -1)]
            assert all(g // (4 // num_mini) == m for m, gs in enumerate(minis) for g in gs)
    assert GroupPartition.of(batch, world=1, num_mini=2).rows[0].tolist() == list(range(8))  # one rank: identity


def test_groups_that_do_not_divide_are_refused():
    with pytest.raises(ValueError, match="4 groups do not make 1 mini-batch"):
        GroupPartition.of(_batch(), world=3)


def test_rank_minis_cuts_a_rank_batch_back_into_its_mini_batch_shares():
    batch = _batch()
    parts, _ = arrange_update(batch, GroupPartition.of(batch, world=2, num_mini=2), norm_len=4.0)
    assert [m["sid"].tolist() for m in rank_minis(parts[1], 2)] == [[0, 1], [6, 7]]
    # One rank (world 1): the mini-batches are the contiguous halves.
    [whole], counts = arrange_update(batch, GroupPartition.of(batch, world=1, num_mini=2), norm_len=4.0)
    assert [m["sid"].tolist() for m in rank_minis(whole, 2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [c.num_tokens for c in counts] == [10.0, 13.0]


def test_micro_batches_are_consecutive_with_a_short_last_one():
    # 8 rows in micro-batches of 3: rows 0-2, 3-5, 6-7.
    mbs = micro_batches(_batch(), 3)
    assert [m["sid"].tolist() for m in mbs] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    # Each keeps only the response columns some row uses: longest lengths 3, 4, 4.
    assert [m["responses"].shape[1] for m in mbs] == [3, 4, 4]
    assert all(pad_response(m["responses"], 4).shape == (len(m), 4) for m in mbs)  # padded back to the batch's 4
