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

    @property
    def pool_plan(self):
        return self.plan.pools[self.pool]

    def sharded(self, role: str) -> bool:
        """Whether `role` (actor or critic) is FSDP2-sharded here: configured so and hosted by this worker."""
        return role in self.roles and getattr(self.cfg, role).sharding == "fsdp2"

    def device(self) -> torch.device:
        # Ray sets CUDA_VISIBLE_DEVICES per actor, so the worker's GPU is always index 0 of what it sees.
        if self.pool_plan.uses_gpu and torch.cuda.is_available():
            return torch.device("cuda", 0)
        return torch.device("cpu")

    def seed_everything(self) -> None:
        seed = self.plan.seed("worker", rank=self.rank)
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)
        # The worker's whole-CPU share (Plan), not torch's default of every core: several workers on one machine
        # must not thrash, and a worker given 2 CPUs must use both. GPU workers too: their host ops are small
        # (batch indexing, packing), and with one OpenMP thread per core each op's barrier waits for any thread
        # another process has preempted: measured on an H200 host, aten::index on a 256-row batch took 8 ms
        # instead of 0.02 ms in such runs, 170 ms before the update's first kernel (bench/RESULTS.md).
        torch.set_num_threads(self.pool_plan.cpu_threads)
        if self.cfg.cluster.backend == "ray":  # the local backend's worker is the driver: its env stays the user's
            share_tokenizer_threads(self.pool_plan.cpu_threads, self.cfg.cluster.env)


def share_tokenizer_threads(threads: int, user_env: dict[str, str]) -> None:
    """A Ray worker given several CPUs decodes its responses with that many tokenizer threads. Ray workers start with
    TOKENIZERS_PARALLELISM=false (cluster/runtime.py: several one-CPU workers on a machine must not oversubscribe),
    which made the rank-local step's decode serial: scoring 256 samples took 0.067-0.079 s in a Ray worker against
    0.043 s in the driver process (bench/RESULTS.md, the rank-local weak scaling). The Rust backend sizes its
    thread pool from RAYON_NUM_THREADS when it first decodes in parallel, after this. cluster.env wins."""
    if threads > 1 and "TOKENIZERS_PARALLELISM" not in user_env:
        os.environ["TOKENIZERS_PARALLELISM"] = "true"
        os.environ.setdefault("RAYON_NUM_THREADS", str(threads))


def dtype_of(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
