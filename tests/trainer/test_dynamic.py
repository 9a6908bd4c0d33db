"""DAPO dynamic sampling on the controller: all-equal groups are dropped and refilled from more rounds."""
import torch

from fleetrl.batch import Batch
from fleetrl.trainer.dynamic import fill_informative


def _scored(scores: list[float], tag: int) -> Batch:
    n = len(scores)
    return Batch({"scores": torch.tensor(scores), "group": torch.arange(n // 2).repeat_interleave(2),
                  "tag": torch.full((n,), tag)})


def test_refills_to_the_batch_size_with_informative_groups_only():
    # round 1: groups (1, 1) all-equal -> dropped, (0, 1) kept; round 2: (0, 0) dropped, (1, 0) kept -> 2 groups
    rounds = iter([_scored([0.0, 0.0, 1.0, 0.0], tag=2)])
    out, stats = fill_informative(_scored([1.0, 1.0, 0.0, 1.0], tag=1), lambda: next(rounds), groups=2, n=2,
                                  max_rounds=3)
    assert out["scores"].tolist() == [0.0, 1.0, 1.0, 0.0]
    assert out["tag"].tolist() == [1, 1, 2, 2] and out["group"].tolist() == [0, 0, 1, 1]
    assert stats == {"dynamic_sampling/rounds": 2.0, "dynamic_sampling/dropped_groups": 2.0,
                     "dynamic_sampling/shortfall_groups": 0.0}


def test_never_trains_on_an_all_equal_group_when_enough_rounds_exist():
    # every round has one informative group among two: 3 groups need exactly 3 rounds
    rounds = iter([_scored([1.0, 1.0, 0.0, 1.0], tag=t) for t in (2, 3)])
    out, stats = fill_informative(_scored([0.0, 0.0, 1.0, 0.0], tag=1), lambda: next(rounds), groups=3, n=2,
                                  max_rounds=3)
    pairs = out["scores"].view(-1, 2)
    assert len(out) == 6 and bool((pairs[:, 0] != pairs[:, 1]).all())
    assert stats["dynamic_sampling/rounds"] == 3.0 and stats["dynamic_sampling/shortfall_groups"] == 0.0


def test_shortfall_after_the_last_round_is_reported_and_filled():
    out, stats = fill_informative(_scored([1.0, 1.0, 0.0, 1.0], tag=1), lambda: None, groups=2, n=2, max_rounds=1)
    # one informative group; the dropped (1, 1) group fills the second slot (zero advantage, no gradient)
    assert out["scores"].tolist() == [0.0, 1.0, 1.0, 1.0]
    assert stats["dynamic_sampling/shortfall_groups"] == 1.0 and stats["dynamic_sampling/rounds"] == 1.0
