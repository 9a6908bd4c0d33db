"""DAPO dynamic sampling on the controller (Yu et al. 2025, §3.2): groups whose rewards are all equal carry no
GRPO-family gradient, so they are dropped and more prompts are generated until the step has
data.prompts_per_step informative groups, for at most algorithm.dynamic_sampling.max_rounds generation rounds.

A step still short after the last round fills up with the dropped groups (their advantages are zero, so they add
no gradient) because every later phase is sized for prompts_per_step groups; the shortfall is reported.
"""
from __future__ import annotations

from typing import Callable

import torch

from fleetrl.algo import groups_with_varied_scores
from fleetrl.batch import Batch


def fill_informative(first: Batch, more: Callable[[], Batch], *, groups: int, n: int,
                     max_rounds: int) -> tuple[Batch, dict[str, float]]:
    """`first` and each `more()`: scored batches of whole groups (`group` ids 0..k-1, n samples each, in order).
    Returns `groups` whole groups, informative ones first, renumbered 0..groups-1, and the counts."""
    kept: list[Batch] = []
    dropped: list[Batch] = []
    rounds, batch = 0, first
    while True:
        rounds += 1
        keep_B = groups_with_varied_scores(batch["scores"], batch["group"])
        kept += _groups(batch, keep_B, n)
        dropped += _groups(batch, ~keep_B, n)
        if len(kept) >= groups or rounds >= max_rounds:
            break
        batch = more()
    chosen = (kept + dropped)[:groups]
    out = Batch.concat(chosen)
    out.tensors["group"] = torch.arange(groups).repeat_interleave(n)
    stats = {"dynamic_sampling/rounds": float(rounds), "dynamic_sampling/dropped_groups": float(len(dropped)),
             "dynamic_sampling/shortfall_groups": float(max(0, groups - len(kept)))}
    return out, stats


def _groups(batch: Batch, keep_B: torch.Tensor, n: int) -> list[Batch]:
    """The groups of `batch` selected by `keep_B` (constant within a group), one Batch each, in order."""
    starts = [i for i in range(0, len(batch), n) if bool(keep_B[i])]
    return [batch.select(range(s, s + n)) for s in starts]
