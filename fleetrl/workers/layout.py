"""The mini-/micro-batch layout of an update, produced (controller) and consumed (worker) in this one module.

Controller: `arrange_update` splits each mini-batch balanced over the data-parallel ranks; rank r gets its share
of mini-batch 0, then of mini-batch 1, ..., plus the GLOBAL counts of every mini-batch. Worker: `rank_minis`
cuts its batch back into those mini-batches, `micro_batches` cuts one into forward/backward pieces.
"""
from __future__ import annotations

import numpy as np
import torch

from fleetrl.batch import Batch
from fleetrl.models.packing import same_prompt_as_previous
from fleetrl.workers.messages import MiniBatchCounts


def arrange_update(batch: Batch, num_mini: int, world: int, norm_len: float,
                   mask_key: str = "response_mask") -> tuple[list[Batch], tuple[MiniBatchCounts, ...]]:
    """Per-rank batches for an update and the global counts of each mini-batch (tokens of `mask_key`)."""
    parts, _ = order_for_dp(batch, num_mini, world)
    size = len(batch) // num_mini
    mask = batch[mask_key]
    counts = tuple(MiniBatchCounts(num_tokens=float(mask[i * size:(i + 1) * size].sum()), num_seqs=float(size),
                                   norm_len=norm_len) for i in range(num_mini))
    return parts, counts


def order_for_dp(batch: Batch, num_mini: int, world: int) -> tuple[list[Batch], list[np.ndarray]]:
    """Per-rank batches (and, per rank, the rows of `batch` they hold): each mini-batch split balanced by tokens."""
    minis = batch.chunk(num_mini)
    per_rank: list[list[Batch]] = [[] for _ in range(world)]
    per_rank_ix: list[list[np.ndarray]] = [[] for _ in range(world)]
    size = len(batch) // num_mini
    for m, mini in enumerate(minis):
        parts, index = mini.split_balanced(world)
        for r in range(world):
            per_rank[r].append(parts[r])
            per_rank_ix[r].append(index[r] + m * size)
    return [Batch.concat(p) for p in per_rank], [np.concatenate(ix) for ix in per_rank_ix]


def rank_minis(batch: Batch, num_mini: int) -> list[Batch]:
    """This rank's share of each mini-batch (every rank holds the same number of rows of each)."""
    return batch.chunk(num_mini)


def micro_batches(batch: Batch, size: int) -> list[Batch]:
    """Consecutive micro-batches, each with the padding columns that ALL its rows share removed (prompt columns
    on the left, response columns on the right): a batch padded to its longest sample wastes compute on every
    shorter micro-batch otherwise. Outputs per response token are padded back with `pad_response`."""
    n = len(batch)
    return [trim_padding(batch.select(range(i, min(i + size, n)))) for i in range(0, n, size)]


def token_micro_batches(batch: Batch, max_tokens: int, share_prompts: bool = False) -> list[Batch]:
    """Consecutive micro-batches of at most `max_tokens` real (prompt + response) tokens each, for the packed
    forward; a sample longer than the budget gets a micro-batch of its own. Every row lands in exactly one, in
    order, so losses normalised by the mini-batch's global counts sum to the same total as with sample counts.
    share_prompts: a row with its predecessor's prompt costs its response only, as the packed row holds that
    prompt once (models/packing.py `pack`); the first row of a micro-batch always pays for its prompt."""
    prompt_B, response_B = batch["prompt_mask"].sum(1).tolist(), batch["response_mask"].sum(1).tolist()
    shared_B = (same_prompt_as_previous(batch["prompts"], batch["prompt_mask"]).tolist() if share_prompts
                else [False] * len(batch))
    groups: list[list[int]] = []
    used = max_tokens + 1  # forces a new group for the first row
    for i, (p, r, shared) in enumerate(zip(prompt_B, response_B, shared_B)):
        n = r if shared else p + r
        if used + n > max_tokens:
            groups.append([])
            used, n = 0, p + r
        groups[-1].append(i)
        used += n
    return [trim_padding(batch.select(g)) for g in groups]


def update_micro_batches(batch: Batch, size: int, max_tokens: int | None, share_prompts: bool = False) -> list[Batch]:
    """Token-budget micro-batches when `max_tokens` is set (counting shared prompts once with `share_prompts`),
    else `size` samples each."""
    if max_tokens is None:
        return micro_batches(batch, size)
    return token_micro_batches(batch, max_tokens, share_prompts)


def trim_padding(mb: Batch) -> Batch:
    if "prompt_mask" not in mb or "response_mask" not in mb:
        return mb
    p_cols = mb["prompt_mask"].any(0).nonzero()
    r_cols = mb["response_mask"].any(0).nonzero()
    p0 = int(p_cols[0]) if len(p_cols) else mb["prompt_mask"].shape[1] - 1
    r1 = int(r_cols[-1]) + 1 if len(r_cols) else 1
    full_r = mb["response_mask"].shape[1]
    tensors = {}
    for k, v in mb.tensors.items():
        if k in ("prompts", "prompt_mask"):
            tensors[k] = v[:, p0:]
        elif v.dim() >= 2 and v.shape[1] == full_r:
            tensors[k] = v[:, :r1]
        else:
            tensors[k] = v
    return Batch(tensors, dict(mb.fields), {**mb.meta, "full_response_len": full_r})


def pad_response(x_BR: torch.Tensor, full_r: int) -> torch.Tensor:
    return torch.nn.functional.pad(x_BR, (0, full_r - x_BR.shape[1]))
