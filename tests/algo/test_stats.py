import math

import torch
from torch.testing import assert_close

from fleetrl.algo.stats import masked_mean, masked_sum, masked_var, masked_whiten

X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
M = torch.tensor([[1, 1, 0], [1, 0, 0]])


def test_masked_sum():
    # kept entries 1, 2 | 4 -> 7 overall, [3, 4] per row
    assert_close(masked_sum(X, M), torch.tensor(7.0))
    assert_close(masked_sum(X, M, dim=1), torch.tensor([3.0, 4.0]))


def test_masked_sum_ignores_nan_in_padding():
    x = torch.tensor([[1.0, float("nan")]])
    assert_close(masked_sum(x, torch.tensor([[1, 0]])), torch.tensor(1.0))


def test_masked_mean():
    # 7 / 3 tokens overall; rows: (1 + 2) / 2 = 1.5 and 4 / 1 = 4
    assert_close(masked_mean(X, M), torch.tensor(7.0 / 3.0))
    assert_close(masked_mean(X, M, dim=1), torch.tensor([1.5, 4.0]))


def test_masked_mean_empty_row_is_zero():
    # row 1 has no valid token: 0 instead of 0/0 = NaN
    out = masked_mean(X, torch.tensor([[1, 1, 1], [0, 0, 0]]), dim=1)
    assert_close(out, torch.tensor([2.0, 0.0]))


def test_masked_var():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    m = torch.tensor([1, 1, 1, 0])
    # mean 2, squared deviations 1, 0, 1 -> sum 2; biased 2 / 3, unbiased 2 / (3 - 1) = 1
    assert_close(masked_var(x, m, unbiased=False), torch.tensor(2.0 / 3.0))
    assert_close(masked_var(x, m), torch.tensor(1.0))
    assert_close(masked_var(x, m), x[:3].var())


def test_masked_var_single_element_is_zero():
    assert_close(masked_var(torch.tensor([5.0, 9.0]), torch.tensor([1, 0])), torch.tensor(0.0))


def test_masked_whiten():
    x = torch.tensor([[2.0, 4.0, 6.0, 100.0]])
    m = torch.tensor([[1, 1, 1, 0]])
    # mean 4, unbiased var (4 + 0 + 4) / 2 = 4, std 2 -> [-1, 0, 1]; masked position -> 0
    assert_close(masked_whiten(x, m), torch.tensor([[-1.0, 0.0, 1.0, 0.0]]))
    # shift_mean=False adds the mean 4 back: [3, 4, 5]
    assert_close(masked_whiten(x, m, shift_mean=False), torch.tensor([[3.0, 4.0, 5.0, 0.0]]))


def test_masked_whiten_constant_input_is_zero_not_nan():
    out = masked_whiten(torch.ones(2, 2), torch.ones(2, 2))
    assert not math.isnan(out.sum().item())
    assert_close(out, torch.zeros(2, 2))
