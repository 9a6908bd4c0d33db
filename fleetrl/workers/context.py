"""What a worker knows about itself: the run, its rank in its pool, the roles it hosts, its device."""
from __future__ import annotations

import os
import random
from dataclasses import dataclass

import numpy as np
import torch

from fleetrl.config.plan import Plan


@dataclass(frozen=True, kw_only=True)
class WorkerContext:
    plan: Plan
    pool: str
    roles: tuple[str, ...]
    rank: int
    world_size: int

    @property
    def cfg(self):
        return self.plan.config

    def device(self) -> torch.device:
        # Ray sets CUDA_VISIBLE_DEVICES per actor, so the worker's GPU is always index 0 of what it sees.
        if self.plan.pools[self.pool].bundle.get("GPU", 0) > 0 and torch.cuda.is_available():
            return torch.device("cuda", 0)
        return torch.device("cpu")

    def seed_everything(self) -> None:
        seed = self.cfg.trainer.seed * 1000 + self.rank
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)
        # CPU runs: one intra-op thread per worker keeps several workers on a 2-core machine from thrashing
        # and makes reductions independent of how many cores a worker happens to get.
        if self.device().type == "cpu":
            torch.set_num_threads(int(os.environ.get("FLEETRL_CPU_THREADS", "1")))


def dtype_of(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
