"""MixtureSampler: which (task, index) pairs come next, reproducible from a seed and resumable mid-epoch."""
from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from fleetrl.data.errors import DataError


class MixtureSampler:
    """Draws prompts from one or more tasks.

    Within a task, indices follow a permutation that is a pure function of (seed, task epoch, task name), so
    it never has to be stored: a checkpoint holds only counters and the task-choice RNG state. With several
    tasks each draw first picks a task with probability proportional to its weight (default: its size),
    using one uniform number per draw, so `next_indices(4)` twice equals `next_indices(8)` once.
    """

    def __init__(self, sizes: dict[str, int], weights: Mapping[str, float] | None, *, seed: int,
                 shuffle: bool = True) -> None:
        self.tasks: list[str] = list(sizes)
        self.sizes = dict(sizes)
        self.shuffle = shuffle
        self._seed = seed % 2**63  # SeedSequence rejects negative seeds
        self._cdf = _cdf(self.sizes, weights)
        self._rng = np.random.default_rng(self._seed)
        self._positions = {t: 0 for t in self.tasks}
        self._task_epochs = {t: 0 for t in self.tasks}
        self._draws = 0
        self._perm_cache: dict[str, tuple[int, np.ndarray]] = {}

    @property
    def epoch(self) -> int:
        """Completed passes: with one task, its epoch; with several, draws // total size (dataset passes)."""
        return self._draws // sum(self.sizes.values())

    @property
    def task_epochs(self) -> dict[str, int]:
        return dict(self._task_epochs)

    def next_indices(self, k: int) -> list[tuple[str, int]]:
        """The next k draws as (task, index within that task's dataset)."""
        if len(self.tasks) == 1:
            picks = [0] * k  # one task: no RNG draw, so the stream is the plain epoch-by-epoch walk
        else:
            picks = np.searchsorted(self._cdf, self._rng.random(k), side="right").tolist()
        self._draws += k
        return [(self.tasks[p], self._next_in(self.tasks[p])) for p in picks]

    def _next_in(self, task: str) -> int:
        index = int(self._permutation(task)[self._positions[task]])
        self._positions[task] += 1
        if self._positions[task] == self.sizes[task]:  # roll over eagerly so `epoch` counts finished passes
            self._positions[task] = 0
            self._task_epochs[task] += 1
        return index

    def _permutation(self, task: str) -> np.ndarray:
        epoch = self._task_epochs[task]
        cached = self._perm_cache.get(task)
        if cached is None or cached[0] != epoch:
            n = self.sizes[task]
            # crc32, not hash(): str hashes are salted per process and would break resuming.
            rng = np.random.default_rng([self._seed, epoch, zlib.crc32(task.encode())])
            cached = (epoch, rng.permutation(n) if self.shuffle else np.arange(n))
            self._perm_cache[task] = cached
        return cached[1]

    # ------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state; restoring it reproduces exactly the same future draws."""
        return {"seed": self._seed, "shuffle": self.shuffle, "sizes": dict(self.sizes), "draws": self._draws,
                "positions": dict(self._positions), "task_epochs": dict(self._task_epochs),
                "rng": self._rng.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if dict(state["sizes"]) != self.sizes:
            raise DataError(f"cannot resume the data sampler: the checkpoint was saved with task sizes "
                            f"{state['sizes']}, the data now has {self.sizes}. Resume with the same data files "
                            "and data.max_prompt_length, or start a new run")
        self._seed = int(state["seed"])
        self.shuffle = bool(state["shuffle"])
        self._draws = int(state["draws"])
        self._positions = {t: int(v) for t, v in state["positions"].items()}
        self._task_epochs = {t: int(v) for t, v in state["task_epochs"].items()}
        self._rng.bit_generator.state = state["rng"]
        self._perm_cache.clear()


def mixture_probabilities(sizes: dict[str, int], weights: Mapping[str, float] | None) -> dict[str, float]:
    """Per-task sampling probabilities: `weights` normalised, or task sizes normalised when None.

    Raises DataError for empty tasks and for weights that name unknown tasks, miss a task, or are invalid.
    """
    if not sizes:
        raise DataError("no data tasks to sample from; set data.train (a path, list of paths or {task: path})")
    empty = [t for t, n in sizes.items() if n <= 0]
    if empty:
        raise DataError(f"data tasks {empty} have no prompts; remove them or fix their files")
    weights = dict(sizes) if weights is None else _check_weights(sizes, weights)
    total = float(sum(weights.values()))
    return {t: float(weights[t]) / total for t in sizes}


def _cdf(sizes: dict[str, int], weights: Mapping[str, float] | None) -> np.ndarray:
    cdf = np.cumsum(np.array(list(mixture_probabilities(sizes, weights).values()), dtype=np.float64))
    cdf[-1] = 1.0  # rounding must never let a uniform draw in [0, 1) fall past the last task
    return cdf


def _check_weights(sizes: dict[str, int], weights: Mapping[str, float]) -> Mapping[str, float]:
    unknown = sorted(set(weights) - set(sizes))
    if unknown:
        raise DataError(f"data.weights names unknown tasks {unknown}; the tasks are {list(sizes)}")
    missing = [t for t in sizes if t not in weights]
    if missing:
        raise DataError(f"data.weights has no weight for tasks {missing}; give every task in {list(sizes)} a "
                        "weight, or drop data.weights to sample in proportion to task size")
    bad = {t: w for t, w in weights.items() if not (isinstance(w, (int, float)) and math.isfinite(w) and w >= 0)}
    if bad or not sum(weights.values()) > 0:
        raise DataError(f"data.weights must be finite, non-negative numbers with a positive sum; got {weights}")
    return weights
