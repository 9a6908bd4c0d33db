"""The mini-/micro-batch layout of an update, produced (controller) and consumed (worker) in this one module.

Controller: `arrange_update` hands each data-parallel rank its rows of the step's `GroupPartition` (batch.py: whole
groups, each mini-batch's groups balanced by tokens); rank r gets its share of mini-batch 0, then of mini-batch
1, ..., plus the GLOBAL counts of every mini-batch. Worker: `rank_minis`
cuts its batch back into those mini-batches, `micro_batches` cuts one into forward/backward pieces.
"""
from __future__ import annotations

import torch

from fleetrl.batch import Batch, GroupPartition
from fleetrl.models.packing import same_prompt_as_previous
from fleetrl.workers.messages import MiniBatchCounts


def arrange_update(batch: Batch, partition: GroupPartition, norm_len: float,
                   mask_key: str = "response_mask") -> tuple[list[Batch], tuple[MiniBatchCounts, ...]]:
    """Per-rank batches for an update (the step's group partition: whole groups, each rank its share of every
    mini-batch in order) and the global counts of each mini-batch (tokens of `mask_key`). A mini-batch is a
    contiguous run of whole groups of `batch`, the same at every world size."""
    size = len(batch) // partition.num_mini
    mask = batch[mask_key]
    counts = tuple(MiniBatchCounts(num_tokens=float(mask[i * size:(i + 1) * size].sum()), num_seqs=float(size),
                                   norm_len=norm_len) for i in range(partition.num_mini))
    return batch.split_groups(partition), counts


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
    return [trim_padding(batch.select(g)) for g in _budget_groups(*_row_tokens(batch, share_prompts), max_tokens)]


def update_micro_batches(batch: Batch, size: int, max_tokens: int | None, share_prompts: bool = False) -> list[Batch]:
    """Token-budget micro-batches when `max_tokens` is set (counting shared prompts once with `share_prompts`),
    else `size` samples each."""
    if max_tokens is None:
        return micro_batches(batch, size)
    return token_micro_batches(batch, max_tokens, share_prompts)


def split_micro_batches(batch: Batch, count: int, max_tokens: int | None, share_prompts: bool = False) -> list[Batch]:
    """`batch` cut into `count` consecutive micro-batches (one per row if it has fewer rows), every row in exactly
    one, in order: what a rank runs when another rank's rows made more micro-batches than its own (FSDP2 ranks run
    as many; engines/sharding.py). With a token budget they are balanced by tokens (the largest as small as it can
    be, so within the budget), else by rows (at most the rows `size` allowed, as `count` is at least this rank's own
    count)."""
    n = len(batch)
    count = min(count, n)
    if max_tokens is None:
        q, extra = divmod(n, count)
        starts = [i * q + min(i, extra) for i in range(count + 1)]
        return [trim_padding(batch.select(range(a, b))) for a, b in zip(starts, starts[1:])]
    full, cont = _row_tokens(batch, share_prompts)
    # Search budgets up to max_tokens, which this rank's own cut (fewer than `count` micro-batches) shows feasible;
    # a row over the budget stands alone at any budget. Starting at the longest row instead let a row longer than
    # max_tokens raise the budget of every other micro-batch past max_tokens (34 tokens under a budget of 30).
    lo, hi = 1, min(max_tokens, sum(full))
    while lo < hi:  # the smallest largest micro-batch that `count` of them allow (greedy packing is optimal)
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if len(_budget_groups(full, cont, mid)) <= count else (mid + 1, hi)
    groups = _budget_groups(full, cont, lo)

    def tokens(g: list[int]) -> int:
        return full[g[0]] + sum(cont[i] for i in g[1:])

    while len(groups) < count:  # fewer at that size: cut the largest with two rows or more where it halves best
        k = max((j for j, g in enumerate(groups) if len(g) > 1), key=lambda j: tokens(groups[j]))
        g = groups.pop(k)
        cut = min(range(1, len(g)), key=lambda c: max(tokens(g[:c]), tokens(g[c:])))
        groups[k:k] = [g[:cut], g[cut:]]
    return [trim_padding(batch.select(g)) for g in groups]


def _row_tokens(batch: Batch, share_prompts: bool) -> tuple[list[int], list[int]]:
    """Per row, its tokens when it starts a micro-batch and when it follows another (its response only if it
    shares its predecessor's prompt)."""
    prompt_B, response_B = batch["prompt_mask"].sum(1).tolist(), batch["response_mask"].sum(1).tolist()
    shared_B = (same_prompt_as_previous(batch["prompts"], batch["prompt_mask"]).tolist() if share_prompts
                else [False] * len(batch))
    full = [p + r for p, r in zip(prompt_B, response_B)]
    return full, [r if shared else f for f, r, shared in zip(full, response_B, shared_B)]


def _budget_groups(full: list[int], cont: list[int], max_tokens: int) -> list[list[int]]:
    groups: list[list[int]] = []
    used = max_tokens + 1  # forces a new group for the first row
    for i, (f, c) in enumerate(zip(full, cont)):
        n = c
        if used + n > max_tokens:
            groups.append([])
            used, n = 0, f
        groups[-1].append(i)
        used += n
    return groups


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
    return Batch(tensors, dict(mb.fields), dict(mb.meta))


def pad_response(x_BR: torch.Tensor, full_r: int) -> torch.Tensor:
    return torch.nn.functional.pad(x_BR, (0, full_r - x_BR.shape[1]))
