"""`split_micro_batches` (workers/layout.py): a rank's rows re-cut into as many micro-batches as another rank's made,
so FSDP2 ranks run equal counts without zero-loss passes (engines/sharding.py). Every row once, in order."""
from __future__ import annotations

import torch

from fleetrl.batch import Batch
from fleetrl.workers.layout import split_micro_batches, token_micro_batches


def _batch(prompt_lens: list[int], response_lens: list[int], prompt_ids: list[int] | None = None) -> Batch:
    """Left-padded prompts of token `prompt_ids[i]` (default: the row index + 1, so no two rows share a prompt)."""
    p, r = max(prompt_lens), max(response_lens)
    ids = prompt_ids or [i + 1 for i in range(len(prompt_lens))]
    prompt_mask = torch.tensor([[0] * (p - n) + [1] * n for n in prompt_lens])
    response_mask = torch.tensor([[1] * n + [0] * (r - n) for n in response_lens])
    return Batch({"prompts": prompt_mask * torch.tensor(ids)[:, None], "prompt_mask": prompt_mask,
                  "responses": response_mask * 5, "response_mask": response_mask,
                  "row": torch.arange(len(prompt_lens))})


def _rows(mbs: list[Batch]) -> list[list[int]]:
    return [mb["row"].tolist() for mb in mbs]


# tokens per row (1-token prompts): 2 3 4 5 5 5 5 2, 31 in all; a budget of 16 cuts them into 3 micro-batches
LENGTHS = [1, 2, 3, 4, 4, 4, 4, 1]
BATCH = _batch([1] * 8, LENGTHS)


def test_token_split_makes_the_largest_micro_batch_as_small_as_the_count_allows():
    assert _rows(token_micro_batches(BATCH, 16)) == [[0, 1, 2, 3], [4, 5, 6], [7]]  # 14, 15, 2 tokens
    # 4: at most 9 tokens each would take 5 ([2 3 4] [5] [5] [5] [5 2]); at most 10 takes 4: 9, 10, 10, 2
    assert _rows(split_micro_batches(BATCH, 4, 16)) == [[0, 1, 2], [3, 4], [5, 6], [7]]
    # 6: at most 6 would take 7; at most 7: [2 3] [4] [5] [5] [5] [5 2]
    assert _rows(split_micro_batches(BATCH, 6, 16)) == [[0, 1], [2], [3], [4], [5], [6, 7]]


def test_a_count_the_smallest_size_undershoots_halves_the_largest():
    # four rows of 4 tokens in 3: at most 7 tokens takes 4 micro-batches, at most 8 only 2 ([0 1] [2 3]); the
    # first of those is cut in two
    batch = _batch([1] * 4, [3] * 4)
    assert _rows(split_micro_batches(batch, 3, 100)) == [[0], [1], [2, 3]]


def test_a_shared_prompt_is_counted_once_as_in_the_token_budget():
    # rows 0-2 share a 4-token prompt (5 tokens alone, 1 after their predecessor), row 3 has its own (7 tokens):
    # shared, [0 1 2] is 7 tokens and [3] 7; counted in full, the best two are [0 1] (10) and [2 3] (12)
    batch = _batch([4, 4, 4, 1], [1, 1, 1, 6], prompt_ids=[3, 3, 3, 9])
    assert _rows(split_micro_batches(batch, 2, 16, share_prompts=True)) == [[0, 1, 2], [3]]
    assert _rows(split_micro_batches(batch, 2, 16)) == [[0, 1], [2, 3]]


def test_sample_split_is_balanced_by_rows():
    assert _rows(split_micro_batches(BATCH, 3, None)) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert _rows(split_micro_batches(BATCH, 5, None)) == [[0, 1], [2, 3], [4, 5], [6], [7]]


def test_more_micro_batches_than_rows_gives_one_row_each_and_trims_padding():
    mbs = split_micro_batches(BATCH, 10, 16)
    assert _rows(mbs) == [[i] for i in range(8)]  # the rest are the caller's (unavoidable) repeats
    assert [mb["responses"].shape[1] for mb in mbs] == LENGTHS
    assert all(mb["responses"].shape[1] <= 4 for mb in mbs)  # trimmed; pad_response pads back to the batch's 4


def test_a_row_over_the_budget_does_not_raise_the_budget_of_the_others():
    # tokens 10 32 2 26 11 14 39 34 (1-token prompts): a budget of 30 leaves 32, 39 and 34 alone; cut into 7, the
    # others must stay within 30 (a search starting at the longest row, 39, packed 32 + 2 = 34 together)
    tokens = [10, 32, 2, 26, 11, 14, 39, 34]
    batch = _batch([1] * 8, [t - 1 for t in tokens])
    mbs = split_micro_batches(batch, 7, 30)
    assert sum(_rows(mbs), []) == list(range(8)) and len(mbs) == 7
    for rows in _rows(mbs):
        assert len(rows) == 1 or sum(tokens[i] for i in rows) <= 30, rows
