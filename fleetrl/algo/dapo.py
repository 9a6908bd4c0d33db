"""DAPO's batch-shaping pieces (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at
Scale"), as pure functions the trainer composes:

  overlong_penalty       "soft overlong punishment" (DAPO eq. 13): a length penalty added to the score
  mask_truncated         "overlong filtering": truncated responses contribute no loss
  groups_with_varied_scores  "dynamic sampling": keep only groups whose rewards are not all equal

Why dynamic sampling: a group-relative estimator (grpo, drgrpo, rloo) gives every sample of an all-equal group
an advantage of exactly 0, so such groups add no gradient but still dilute the per-token mean; DAPO drops them
and generates more prompts until the batch is full.
"""
from __future__ import annotations

import torch
from torch import Tensor


def overlong_penalty(lengths_B: Tensor, max_len: int, buffer: int, factor: float = 1.0) -> Tensor:
    """[B] penalty (<= 0) to add to the scores; lengths_B: [B] response lengths (e.g. response_mask.sum(1)).

    With L = max_len (the rollout's max_new_tokens) and C = buffer (DAPO's L_cache):
      0                      for length <= L - C
      factor * (L - C - length) / C   for L - C < length <= L   (linear from 0 down to -factor)
      -factor                for length > L
    DAPO uses L = 20480, C = 4096, factor 1.
    """
    if not 0 < buffer <= max_len:
        raise ValueError(f"overlong buffer must be in (0, max_len={max_len}] tokens; got {buffer}. It is the "
                         "number of tokens before max_new_tokens over which the penalty ramps to -factor")
    over_B = lengths_B.to(torch.float32) - (max_len - buffer)
    return -factor * (over_B / buffer).clamp(0.0, 1.0)


def mask_truncated(mask_BT: Tensor, truncated_B: Tensor) -> Tensor:
    """[B, T] mask_BT with the rows of truncated responses zeroed (DAPO overlong filtering).

    truncated_B: [B] bool, True where generation stopped at the length limit (finish reason "length"). A cut-off
    answer is not necessarily wrong, so its (usually low) reward is a noisy signal; excluding it from the loss
    removes that noise. The samples still take part in group baselines (advantages are computed before this);
    loss aggregation must use token/sequence counts of the NEW mask.
    """
    if truncated_B.shape != mask_BT.shape[:1]:
        raise ValueError(f"truncated_B has shape {tuple(truncated_B.shape)}; expected ({mask_BT.shape[0]},) to "
                         f"match mask_BT {tuple(mask_BT.shape)}")
    return torch.where(truncated_B.bool().unsqueeze(1), torch.zeros_like(mask_BT), mask_BT)


def groups_with_varied_scores(scores_B: Tensor, group_B: Tensor, atol: float = 0.0) -> Tensor:
    """[B] bool keep mask: True for every sample whose group's scores are not all equal (max - min > atol).

    scores_B: [B] sequence scores; group_B: [B] group ids (samples of one prompt share an id; need not be sorted).
    A group of one is all-equal by definition and never kept. atol=0 compares exactly: any difference keeps.
    """
    if scores_B.shape != group_B.shape or scores_B.dim() != 1:
        raise ValueError(f"scores_B and group_B must both be [B]; got {tuple(scores_B.shape)} and "
                         f"{tuple(group_B.shape)}")
    _, inv_B = torch.unique(group_B, return_inverse=True)
    num_groups = int(inv_B.max()) + 1 if inv_B.numel() else 0
    scores_B = scores_B.to(torch.float64)
    max_G = scores_B.new_full((num_groups,), -torch.inf).scatter_reduce(0, inv_B, scores_B, "amax")
    min_G = scores_B.new_full((num_groups,), torch.inf).scatter_reduce(0, inv_B, scores_B, "amin")
    return ((max_G - min_G) > atol)[inv_B]
