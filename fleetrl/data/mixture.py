"""load_dataset: a data spec (path, {task: path}, or synthetic:NAME?k=v) -> MixtureDataset of PromptDatasets."""
from __future__ import annotations

import os
from typing import Any
from urllib.parse import parse_qsl

from fleetrl.batch import Batch
from fleetrl.data.collate import collate
from fleetrl.data.dataset import PromptDataset
from fleetrl.data.errors import DataError
from fleetrl.data.readers import read_rows
from fleetrl.data.records import PromptRecord
from fleetrl.data.sampler import MixtureSampler, mixture_probabilities
from fleetrl.data.schema import normalise_row
from fleetrl.data.synthetic import SYNTHETIC_TASKS

SYNTHETIC_PREFIX = "synthetic:"

DataSpec = str | list[str] | dict[str, str]


class MixtureDataset:
    """Named tasks, each a PromptDataset, plus the per-task sampling weights (None = proportional to size)."""

    def __init__(self, datasets: dict[str, PromptDataset], weights: dict[str, float] | None = None) -> None:
        self.datasets = datasets
        self.weights = weights
        self.probabilities = mixture_probabilities(self.sizes, weights)  # validates weights early

    @property
    def tasks(self) -> list[str]:
        return list(self.datasets)

    @property
    def sizes(self) -> dict[str, int]:
        return {t: len(d) for t, d in self.datasets.items()}

    @property
    def num_filtered(self) -> int:
        return sum(d.num_filtered for d in self.datasets.values())

    @property
    def data_sources(self) -> set[str]:
        """Every data_source in the data; give it to RewardRouter.check_sources before training starts."""
        return set().union(*(d.data_sources for d in self.datasets.values()))

    def __len__(self) -> int:
        return sum(self.sizes.values())

    def __getitem__(self, key: tuple[str, int]) -> tuple[PromptRecord, list[int]]:
        task, index = key
        return self.datasets[task][index]

    def make_sampler(self, *, seed: int, shuffle: bool = True) -> MixtureSampler:
        return MixtureSampler(self.sizes, self.weights, seed=seed, shuffle=shuffle)

    def next_batch(self, sampler: MixtureSampler, batch_size: int, pad_id: int) -> Batch:
        """Draws `batch_size` prompts from `sampler` and collates them."""
        return collate([self[key] for key in sampler.next_indices(batch_size)], pad_id)


def load_dataset(spec: DataSpec, tokenizer: Any, *, weights: dict[str, float] | None = None,
                 input_key: str = "prompt", label_key: str | None = None, default_data_source: str | None = None,
                 max_prompt_length: int, apply_chat_template: bool = True) -> MixtureDataset:
    """Reads, normalises and tokenizes every task of `spec`.

    `spec`: a path (.parquet/.jsonl/.json), a list of paths (one task per file, named by file stem), a
    `{task_name: path}` dict, or `synthetic:NAME?key=val&...` anywhere a path is accepted. Rows without a
    data_source get `default_data_source` when set, else their task name (file stem or synthetic NAME
    for a bare path), so a `{gsm8k: ..., math: ...}` mixture routes to the right reward without extra config.
    """
    datasets = {}
    for task, source in task_sources(spec).items():
        rows, file = _rows(source)
        records = [normalise_row(raw, file=file, row=i, input_key=input_key, label_key=label_key,
                                 default_data_source=default_data_source or task) for i, raw in enumerate(rows)]
        datasets[task] = PromptDataset(records, tokenizer, max_prompt_length=max_prompt_length,
                                       apply_chat_template=apply_chat_template)
    return MixtureDataset(datasets, weights)


def task_sources(spec: DataSpec) -> dict[str, str]:
    """`{task_name: path or synthetic spec}` for any accepted spec shape."""
    if isinstance(spec, dict):
        if not spec:
            raise DataError("the data spec is an empty mapping; give at least one {task_name: path}")
        bad = {k: v for k, v in spec.items() if not isinstance(v, str)}
        if bad:
            raise DataError(f"data spec tasks {sorted(bad)} are not a single path; give each task one file "
                            "(or one synthetic:NAME spec), e.g. {gsm8k: data/gsm8k.parquet}")
        return {str(k): v for k, v in spec.items()}
    paths = [spec] if isinstance(spec, str) else list(spec)
    tasks: dict[str, str] = {}
    for path in paths:
        name = _task_name(path)
        if name in tasks:
            raise DataError(f"data files {tasks[name]!r} and {path!r} would both be task {name!r}; name the tasks "
                            "explicitly with a mapping {task_name: path}")
        tasks[name] = path
    if not tasks:
        raise DataError("the data spec lists no files; give a path, a list of paths or {task_name: path}")
    return tasks


def _task_name(source: str) -> str:
    if source.startswith(SYNTHETIC_PREFIX):
        return parse_synthetic(source)[0]
    return os.path.splitext(os.path.basename(source))[0]


def _rows(source: str) -> tuple[list[dict], str]:
    if not source.startswith(SYNTHETIC_PREFIX):
        return read_rows(source), source
    name, kwargs = parse_synthetic(source)
    if name not in SYNTHETIC_TASKS:
        raise DataError(f"data spec {source!r}: unknown synthetic task {name!r}; registered tasks are "
                        f"{sorted(SYNTHETIC_TASKS) or 'none'}")
    try:
        rows = SYNTHETIC_TASKS[name](**kwargs)
    except TypeError as exc:  # wrong or missing query parameters
        raise DataError(f"data spec {source!r}: synthetic task {name!r} rejected parameters {kwargs}: {exc}") from exc
    if not rows:
        raise DataError(f"data spec {source!r}: synthetic task {name!r} produced no rows; check its parameters")
    return list(rows), source


def parse_synthetic(spec: str) -> tuple[str, dict[str, Any]]:
    """`synthetic:NAME?n=100&hard=true` -> ("NAME", {"n": 100, "hard": True})."""
    name, _, query = spec[len(SYNTHETIC_PREFIX):].partition("?")
    if not name:
        raise DataError(f"data spec {spec!r} has no task name; write synthetic:NAME?key=val&...")
    return name, {k: _coerce(v) for k, v in parse_qsl(query, keep_blank_values=True)}


def _coerce(value: str) -> Any:
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value
