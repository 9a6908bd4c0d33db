"""collate: (record, prompt_ids) pairs -> a Batch with left-padded prompts and per-sample fields."""
from __future__ import annotations

from typing import Sequence

import torch

from fleetrl.batch import Batch
from fleetrl.data.records import PromptRecord


def collate(items: Sequence[tuple[PromptRecord, list[int]]], pad_id: int) -> Batch:
    """Builds the rollout input batch.

    Tensors: `prompts` [B, P] long, left-padded with `pad_id` (left so every prompt ends at column P-1 and
    generation continues from the same position), `prompt_mask` [B, P] long (1 on real tokens).
    Fields: data_source, ground_truth, extra_info, uid, raw_prompt (messages list or text), ability.
    """
    if not items:
        raise ValueError("collate: got no items; the sampler must draw at least one prompt")
    width = max(len(ids) for _, ids in items)
    prompts = torch.full((len(items), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    for i, (_, ids) in enumerate(items):
        if ids:
            prompts[i, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
            mask[i, width - len(ids):] = 1
    records = [r for r, _ in items]
    fields = {
        "data_source": [r.data_source for r in records],
        "ground_truth": [r.ground_truth for r in records],
        "extra_info": [r.extra_info for r in records],
        "uid": [r.uid for r in records],
        "raw_prompt": [r.raw_prompt for r in records],
        "ability": [r.ability for r in records],
    }
    return Batch({"prompts": prompts, "prompt_mask": mask}, fields)  # Batch turns lists into object arrays
