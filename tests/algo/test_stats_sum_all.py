"""masked_whiten over a batch held in parts (the rank-local step): global statistics through `sum_all`."""
from __future__ import annotations

import torch

from fleetrl.algo.stats import masked_whiten


def test_whitening_two_halves_with_summed_stats_equals_whitening_the_whole():
    x = torch.tensor([[1.0, 2.0, float("nan")], [4.0, 0.0, 0.0], [3.0, 5.0, 7.0], [-1.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]])
    whole = masked_whiten(x, mask)
    halves = [(x[:2], mask[:2]), (x[2:], mask[2:])]
    # "all-reduce" of the two ranks' [count, sum, sum of squares]: 7 tokens, sum 21, squares 105
    stats = [torch.stack([m.sum().double(), torch.where(m.bool(), p.double(), 0.0).sum(),
                          torch.where(m.bool(), p.double() ** 2, 0.0).sum()]) for p, m in halves]
    total = stats[0] + stats[1]
    assert total.tolist() == [7.0, 21.0, 105.0]
    parts = [masked_whiten(p, m, sum_all=lambda _t: total) for p, m in halves]
    # mean 3, unbiased var (105 - 7 * 9) / 6 = 7: the first token (1 - 3) / sqrt(7)
    assert torch.isclose(parts[0][0, 0], torch.tensor(-2 / 7 ** 0.5), atol=1e-6)
    assert torch.allclose(torch.cat(parts), whole, atol=1e-6)
    assert not torch.isnan(torch.cat(parts)).any()  # NaN in padding never leaks
