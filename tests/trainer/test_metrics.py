import pytest

from fleetrl.trainer.metrics import pass_at_k
from fleetrl.workers.messages import UpdateMetrics


def test_update_metrics_sum_shares_and_keep_rank0_norms():
    same = {"actor/grad_norm": 2.0, "actor/lr": 1e-3}
    ranks = [UpdateMetrics.of({"actor/pg_loss": 0.25, "actor/clip_frac": 0.1}, same),
             UpdateMetrics.of({"actor/pg_loss": 0.5, "actor/clip_frac": 0.3}, same)]
    out = UpdateMetrics.reduce(ranks)
    # shares add (0.25 + 0.5, 0.1 + 0.3); grad norm and lr are equal on every rank and taken once
    assert out == pytest.approx({"actor/pg_loss": 0.75, "actor/clip_frac": 0.4, "actor/grad_norm": 2.0,
                                 "actor/lr": 1e-3})


def test_pass_at_k_hand_computed():
    # prompt 1 has a success among its 3 samples, prompt 2 none, prompt 3 all: 2 of 3 prompts pass
    assert pass_at_k([[0, 1, 0], [0, 0, 0.5], [1, 1, 1]]) == pytest.approx(2 / 3)
