"""Batch: the one container that crosses process boundaries between the controller and the workers.

Layout (verl-style, chosen so prompts and responses can be re-padded independently):
  prompts        [B, P]  left-padded prompt token ids         prompt_mask    [B, P]
  responses      [B, R]  right-padded response token ids      response_mask  [B, R]
Every other tensor is per sample ([B]) or per response token ([B, R]). Per-sample Python objects
(data_source, ground truth, text, ...) live in `fields` as 1-D numpy object arrays, and run-level values
(weights version, temperature, ...) in `meta`.

Concatenating batches whose P or R differ re-pads: prompt-aligned tensors on the left, response-aligned
tensors on the right. Which side a tensor is aligned to is known from its name (see `PROMPT_KEYS`), and any
[B, R] tensor is response-aligned.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np
import torch

PROMPT_KEYS = ("prompts", "prompt_mask")
# Pad values by key: ids pad with 0 (masked anyway), masks pad with 0, everything else with 0.0.
_PAD = 0


@dataclass
class Batch:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    fields: dict[str, np.ndarray] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        sizes = {k: v.shape[0] for k, v in self.tensors.items()}
        sizes.update({k: len(v) for k, v in self.fields.items()})
        if len(set(sizes.values())) > 1:
            raise ValueError(f"Batch: inconsistent first dimensions {sizes}")
        for k, v in list(self.fields.items()):
            if not isinstance(v, np.ndarray):
                self.fields[k] = _obj_array(v)

    # ------------------------------------------------------------------ basics
    def __len__(self) -> int:
        for v in self.tensors.values():
            return int(v.shape[0])
        for v in self.fields.values():
            return len(v)
        return 0

    def __getitem__(self, key: str) -> Any:
        if key in self.tensors:
            return self.tensors[key]
        if key in self.fields:
            return self.fields[key]
        raise KeyError(f"Batch has no key {key!r}; it has {sorted(self.tensors) + sorted(self.fields)}")

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.fields

    def update(self, other: "Batch") -> "Batch":
        """Returns a new batch with `other`'s keys added (same samples, same order)."""
        if len(other) and len(self) and len(other) != len(self):
            raise ValueError(f"Batch.update: sizes differ ({len(self)} vs {len(other)})")
        return Batch({**self.tensors, **other.tensors}, {**self.fields, **other.fields},
                     {**self.meta, **other.meta})

    def with_tensors(self, **tensors: torch.Tensor) -> "Batch":
        return Batch({**self.tensors, **tensors}, dict(self.fields), dict(self.meta))

    def pick(self, *keys: str) -> "Batch":
        """A batch with only `keys` (tensors or fields); meta is kept. Cheaper to ship to a worker."""
        return Batch({k: v for k, v in self.tensors.items() if k in keys},
                     {k: v for k, v in self.fields.items() if k in keys}, dict(self.meta))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        """non_blocking: CPU tensors go to a CUDA device through pinned memory without waiting for the GPU (from
        pageable memory a host-to-device copy first waits for every queued kernel to finish)."""
        return Batch({k: upload(v, device) if non_blocking else v.to(device) for k, v in self.tensors.items()},
                     dict(self.fields), dict(self.meta))

    # ---------------------------------------------------------------- indexing
    def select(self, index: Sequence[int] | np.ndarray | torch.Tensor) -> "Batch":
        idx = torch.as_tensor(np.asarray(index, dtype=np.int64))
        idx_np = idx.numpy()
        return Batch({k: v[idx.to(v.device)] for k, v in self.tensors.items()},
                     {k: v[idx_np] for k, v in self.fields.items()}, dict(self.meta))

    def repeat_interleave(self, n: int) -> "Batch":
        """Each sample repeated n times in place: [a, b] -> [a, a, b, b] (GRPO groups stay contiguous)."""
        index = np.repeat(np.arange(len(self)), n)
        return self.select(index)

    def chunk(self, k: int) -> list["Batch"]:
        """k contiguous, equal-size chunks (len must divide)."""
        if len(self) % k:
            raise ValueError(f"Batch.chunk: {len(self)} samples do not split into {k} equal chunks")
        size = len(self) // k
        return [self.select(range(i * size, (i + 1) * size)) for i in range(k)]

    def split_balanced(self, k: int) -> tuple[list["Batch"], list[np.ndarray]]:
        """Splits into k equal-size parts whose token counts are as even as a greedy LPT pass makes them.

        Returns the parts and, for each, the original indices, so results can be put back in order with
        `Batch.gather`. Sizes are equal because data-parallel ranks must run the same number of
        micro-batches (a rank with fewer would skip a collective and hang the group).
        """
        index_parts = balanced_partition(self.token_counts().tolist(), k)
        return [self.select(ix) for ix in index_parts], [np.asarray(ix) for ix in index_parts]

    def split_groups(self, partition: "GroupPartition") -> list["Batch"]:
        """Rank r's rows of `partition` (whole groups, mini-batch by mini-batch); `Batch.gather(parts,
        partition.rows)` puts results back in this batch's order."""
        return [self.select(rows) for rows in partition.rows]

    def group_spans(self) -> list[tuple[int, int]]:
        """[start, end) of each GRPO group: the runs of equal `group` ids. A group is contiguous by construction
        (repeat_interleave); a batch whose ids repeat after another group's would have been reordered, which is
        a bug, not input."""
        group = self.tensors["group"].tolist()
        spans, start = [], 0
        for i in range(1, len(group) + 1):
            if i == len(group) or group[i] != group[start]:
                spans.append((start, i))
                start = i
        assert len({group[a] for a, _ in spans}) == len(spans), "a GRPO group's samples are not contiguous"
        return spans

    def group_tokens(self) -> list[int]:
        """Per group, the tokens a rank computes for it: its prompt once (the packed update and the engine's
        shared prefill run a group's prompt once) plus every response it has so far."""
        prompt = self.tensors["prompt_mask"].sum(1).tolist()
        response = self.tensors["response_mask"].sum(1).tolist() if "response_mask" in self.tensors else None
        return [int(prompt[a]) + (int(sum(response[a:b])) if response is not None else 0)
                for a, b in self.group_spans()]

    def token_counts(self) -> torch.Tensor:
        count = torch.zeros(len(self), dtype=torch.long)
        for key in ("prompt_mask", "response_mask"):
            if key in self.tensors:
                count = count + self.tensors[key].sum(-1).long().cpu()
        return count

    @staticmethod
    def gather(parts: Sequence["Batch"], indices: Sequence[np.ndarray]) -> "Batch":
        """Inverse of split_balanced: concatenates parts and restores the original sample order."""
        merged = Batch.concat(parts)
        order = np.concatenate([np.asarray(ix) for ix in indices])
        inverse = np.empty_like(order)
        inverse[order] = np.arange(len(order))
        return merged.select(inverse)

    # ----------------------------------------------------------------- concat
    @staticmethod
    def concat(parts: Sequence["Batch"]) -> "Batch":
        parts = [p for p in parts if len(p) or p.tensors or p.fields]
        if not parts:
            return Batch()
        keys_t = set(parts[0].tensors)
        keys_f = set(parts[0].fields)
        for p in parts[1:]:
            if set(p.tensors) != keys_t or set(p.fields) != keys_f:
                raise ValueError(f"Batch.concat: keys differ: {sorted(keys_t | keys_f)} vs "
                                 f"{sorted(set(p.tensors) | set(p.fields))}")
        tensors = {k: _cat_padded([p.tensors[k] for p in parts], left=k in PROMPT_KEYS) for k in keys_t}
        fields = {k: _obj_array([x for p in parts for x in p.fields[k]]) for k in keys_f}
        meta: dict[str, Any] = {}
        for p in parts:
            meta.update(p.meta)
        return Batch(tensors, fields, meta)


@dataclass(frozen=True, slots=True)
class GroupPartition:
    """Which rows of a step's batch each data-parallel rank holds. A GRPO group (a prompt and its n samples) is
    never split; each mini-batch's groups are dealt out on their own, so rank r holds its share of mini-batch 0,
    then of mini-batch 1, ... and a mini-batch is the same set of groups at every world size (world 2 trains on
    the same mini-batches as world 1). Made once per step by the controller and used by generate, log-probs and
    update alike, so a sample is scored and trained on the rank that generated it."""
    rows: tuple[np.ndarray, ...]
    """Per rank, the batch row indices it holds, in mini-batch order; each rank holds equally many per mini-batch."""
    num_mini: int

    @property
    def world(self) -> int:
        return len(self.rows)

    @staticmethod
    def of(batch: "Batch", world: int, num_mini: int = 1) -> "GroupPartition":
        """Whole groups over `world` ranks, each mini-batch's groups balanced by `Batch.group_tokens` (greedy
        LPT with equal group counts). Before generation that is the prompt tokens (every group will add n
        responses of the same budget); after it, prompt once plus responses. One rank: the identity, so the
        single-rank numbers are untouched."""
        spans, weight = batch.group_spans(), batch.group_tokens()
        groups = len(spans)
        if groups % num_mini or (groups // num_mini) % world:
            raise ValueError(f"{groups} groups do not make {num_mini} mini-batch(es) of whole groups split evenly over "
                             f"{world} ranks (config/plan.py checks this for a run)")
        per_mini = groups // num_mini
        rows: list[list[np.ndarray]] = [[] for _ in range(world)]
        for m in range(num_mini):
            ids = range(m * per_mini, (m + 1) * per_mini)
            for r, part in enumerate(balanced_partition([weight[g] for g in ids], world)):
                rows[r] += [np.arange(*spans[ids[g]]) for g in part]
        return GroupPartition(rows=tuple(np.concatenate(r) if r else np.zeros(0, np.int64) for r in rows),
                              num_mini=num_mini)


def balanced_partition(weights: Sequence[int], k: int) -> list[list[int]]:
    """Longest-processing-time greedy with an equal-count constraint; each part keeps ascending index order."""
    n = len(weights)
    if k <= 0 or n % k:
        raise ValueError(f"cannot split {n} samples into {k} equal parts; make the batch a multiple of {k}")
    cap = n // k
    heap = [(0, i) for i in range(k)]  # (load, part)
    parts: list[list[int]] = [[] for _ in range(k)]
    for i in sorted(range(n), key=lambda j: (-weights[j], j)):
        full: list[tuple[int, int]] = []
        load, part = heapq.heappop(heap)
        while len(parts[part]) >= cap:
            full.append((load, part))
            load, part = heapq.heappop(heap)
        parts[part].append(i)
        heapq.heappush(heap, (load + weights[i], part))
        for item in full:
            heapq.heappush(heap, item)
    return [sorted(p) for p in parts]


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id rows as left-padded [len(rows), longest] ids and a 0/1 mask (what a rollout engine takes)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r):] = torch.tensor(list(r), dtype=torch.long)
            mask[i, width - len(r):] = 1
    return ids, mask


def _cat_padded(ts: list[torch.Tensor], left: bool) -> torch.Tensor:
    if ts[0].dim() < 2 or all(t.shape[1:] == ts[0].shape[1:] for t in ts):
        return torch.cat(ts, 0)
    width = max(t.shape[1] for t in ts)
    padded = []
    for t in ts:
        gap = width - t.shape[1]
        pad = t.new_full((t.shape[0], gap, *t.shape[2:]), _PAD)
        padded.append(torch.cat([pad, t] if left else [t, pad], 1))
    return torch.cat(padded, 0)


def _obj_array(items: Iterable[Any]) -> np.ndarray:
    items = list(items)
    arr = np.empty(len(items), dtype=object)
    for i, x in enumerate(items):
        arr[i] = x
    return arr


def upload(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A CPU tensor on `device`, queued like a kernel. Why: a plain host-to-GPU copy is from pageable memory and
    then waits for the stream to drain, so the host would stop behind the work it queued to keep the GPU busy
    (the fast engine's decode steps, the update's previous micro-batch); a pinned, non-blocking copy does not."""
    if torch.device(device).type != "cuda" or host.device.type != "cpu":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
