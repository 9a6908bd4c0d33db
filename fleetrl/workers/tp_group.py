"""A rollout pool's tensor-parallel engines (rollout.tensor_parallel = k): ranks [e·k, (e+1)·k) of the pool run
engine e together (engines/fast/tp.py), each with its own process group.

The controller does not know about engines: it deals whole groups to every rank of the pool as at k = 1 (batch.py
GroupPartition), so the step's partition, the log-probs and the update are unchanged. At generate, the k ranks of an
engine put their samples together (one object all-gather inside the engine's group), decode the union as ONE
engine call, with identical inputs on every rank as the TP engine requires, and each rank keeps its own rows. So a
sample still trains on the rank it was dealt to, and scoring stays per rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch.distributed as dist

from fleetrl.batch import Batch


@dataclass(frozen=True, slots=True)
class EngineGroup:
    """This rank's engine: its process group, its index among the pool's engines, its rank in the group."""

    group: object
    engine: int
    rank: int
    size: int

    @classmethod
    def make(cls, pool_rank: int, world: int, k: int) -> "EngineGroup | None":
        """Every rank of the pool calls this (dist.new_group is collective over the default group, and every rank
        must create every group in the same order); None for k = 1."""
        if k == 1:
            return None
        if world % k:
            raise ValueError(f"rollout.tensor_parallel={k} does not divide the pool's {world} ranks")
        mine = None
        for e in range(world // k):
            group = dist.new_group(ranks=list(range(e * k, (e + 1) * k)))
            if e == pool_rank // k:
                mine = group
        return cls(group=mine, engine=pool_rank // k, rank=pool_rank % k, size=k)

    def gather(self, batch: Batch) -> tuple[Batch, np.ndarray]:
        """(the engine's whole batch in group-rank order, this rank's rows of it). The ranks' parts may differ in
        length and prompt width (Batch.concat left-pads prompts to the widest)."""
        parts: list[Batch | None] = [None] * self.size
        dist.all_gather_object(parts, batch, group=self.group)
        start = sum(len(p) for p in parts[:self.rank])
        return Batch.concat(parts), np.arange(start, start + len(batch))
