import pytest
import torch
from torch.testing import assert_close

from fleetrl.algo.dapo import (
    groups_with_varied_scores,
    mask_truncated,
    overlong_penalty,
)


def test_overlong_penalty_linear_over_the_buffer():
    # max_len 10, buffer 4: free up to 10 - 4 = 6 tokens, then (6 - len) / 4
    # len 3 -> 0; 6 -> 0; 7 -> -1/4; 8 -> -2/4; 9 -> -3/4; 10 -> -4/4 = -1; 12 (beyond max) -> -1
    lengths = torch.tensor([3, 6, 7, 8, 9, 10, 12])
    assert_close(overlong_penalty(lengths, max_len=10, buffer=4),
                 torch.tensor([0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0]))


def test_overlong_penalty_factor_and_full_buffer():
    # buffer == max_len: the ramp starts at 0 tokens; len 2 of 8 -> -2/8 = -0.25, times factor 0.5 -> -0.125
    assert_close(overlong_penalty(torch.tensor([2, 8]), max_len=8, buffer=8, factor=0.5),
                 torch.tensor([-0.125, -0.5]))


@pytest.mark.parametrize("buffer", [0, 11])
def test_overlong_penalty_rejects_bad_buffer(buffer):
    with pytest.raises(ValueError, match=r"overlong buffer must be in \(0, max_len=10\]"):
        overlong_penalty(torch.tensor([1]), max_len=10, buffer=buffer)


def test_mask_truncated_zeroes_whole_rows():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]])
    out = mask_truncated(mask, torch.tensor([True, False, False]))
    assert torch.equal(out, torch.tensor([[0, 0, 0], [1, 1, 0], [1, 1, 1]]))
    with pytest.raises(ValueError, match=r"truncated_B has shape \(2,\); expected \(3,\)"):
        mask_truncated(mask, torch.tensor([True, False]))


def test_groups_with_varied_scores():
    # group 7: [1, 0] varied -> kept; group 3: [0.5, 0.5, 0.5] all equal -> dropped; group 5: one sample ->
    # dropped; group 9 (interleaved with 7): [0, 0.25] varied -> kept
    scores = torch.tensor([1.0, 0.5, 0.0, 0.5, 0.2, 0.5, 0.0, 0.25])
    group = torch.tensor([7, 3, 7, 3, 5, 3, 9, 9])
    keep = groups_with_varied_scores(scores, group)
    assert keep.tolist() == [True, False, True, False, False, False, True, True]


@pytest.mark.parametrize("value", [0.0, 1.0, -3.5, 0.1 + 0.2])
def test_all_equal_group_is_never_kept(value):
    # four groups of 4 with the same score in each, at several values; nothing may be kept
    scores = torch.full((16,), value)
    group = torch.arange(4).repeat_interleave(4)
    assert not groups_with_varied_scores(scores, group).any()


def test_groups_with_varied_scores_tolerance():
    # max - min = 1e-9: kept with exact comparison, dropped with atol 1e-6
    scores, group = torch.tensor([0.3, 0.3 + 1e-9], dtype=torch.float64), torch.tensor([0, 0])
    assert groups_with_varied_scores(scores, group).all()
    assert not groups_with_varied_scores(scores, group, atol=1e-6).any()
