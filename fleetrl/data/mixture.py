"""load_dataset: a data spec (path, {task: path}, or synthetic:NAME?k=v) -> MixtureDataset of PromptDatasets."""
from __future__ import annotations

import inspect
import os
import typing
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import parse_qsl

from fleetrl.batch import Batch
from fleetrl.data.collate import collate
from fleetrl.data.dataset import PromptDataset
from fleetrl.data.errors import DataError
from fleetrl.data.readers import read_rows
from fleetrl.data.records import PromptRecord
from fleetrl.data.sampler import MixtureSampler, mixture_probabilities
from fleetrl.data.schema import check_input_column, normalise_row
from fleetrl.data.synthetic import SYNTHETIC_TASKS

SYNTHETIC_PREFIX = "synthetic:"

# Loaded configs hold FrozenDict / tuple in place of dict / list, so specs are checked as Mapping / Sequence.
DataSpec = str | Sequence[str] | Mapping[str, str]
# Which config key a spec came from, for messages; load_dataset's caller knows whether it is train or val.
DEFAULT_KEY = "data.train / data.val"
SPEC_FORMS = ("a path (.parquet/.jsonl/.json), a list of paths, a {task_name: path} mapping, or "
              "synthetic:NAME?key=val&...")


class MixtureDataset:
    """Named tasks, each a PromptDataset, plus the per-task sampling weights (None = proportional to size)."""

    def __init__(self, datasets: dict[str, PromptDataset], weights: Mapping[str, float] | None = None) -> None:
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


def load_dataset(spec: DataSpec, tokenizer: Any, *, weights: Mapping[str, float] | None = None, key: str = DEFAULT_KEY,
                 input_key: str = "prompt", label_key: str | None = None, default_data_source: str | None = None,
                 max_prompt_length: int, apply_chat_template: bool = True) -> MixtureDataset:
    """Reads, normalises and tokenizes every task of `spec`.

    `spec`: a path (.parquet/.jsonl/.json), a list of paths (one task per file, named by file stem), a
    `{task_name: path}` dict, or `synthetic:NAME?key=val&...` anywhere a path is accepted. Rows without a
    data_source get `default_data_source` when set, else their task name (file stem or synthetic NAME
    for a bare path), so a `{gsm8k: ..., math: ...}` mixture routes to the right reward without extra config.
    `key` is the config key `spec` came from (e.g. "data.val"), named in errors about the spec's shape.
    """
    datasets = {}
    for task, source in task_sources(spec, key).items():
        rows, file = _rows(source)
        check_input_column(rows, file, input_key)  # a column no row has is the setting's fault, not row 0's
        records = [normalise_row(raw, file=file, row=i, input_key=input_key, label_key=label_key,
                                 default_data_source=default_data_source or task, column_in_file=True)
                   for i, raw in enumerate(rows)]
        datasets[task] = PromptDataset(records, tokenizer, max_prompt_length=max_prompt_length,
                                       apply_chat_template=apply_chat_template)
    return MixtureDataset(datasets, weights)


def task_sources(spec: DataSpec, key: str = DEFAULT_KEY) -> dict[str, str]:
    """`{task_name: path or synthetic spec}` for any accepted spec shape."""
    if isinstance(spec, Mapping):
        return _mapping_sources(spec, key)
    if isinstance(spec, str):
        paths: Sequence[Any] = [spec]
    elif isinstance(spec, Sequence):
        paths = spec
    else:
        raise DataError(f"{key} is {spec!r} (type {type(spec).__name__}); expected {SPEC_FORMS}")
    tasks: dict[str, str] = {}
    for i, path in enumerate(paths):
        if not isinstance(path, str):
            raise DataError(f"{key}[{i}] is {path!r} (type {type(path).__name__}); each list entry must be a path "
                            "or a synthetic:NAME spec; to name tasks use a mapping {task_name: path}")
        name = _task_name(path)
        if name in tasks:
            example = f"{{{name}_1: {tasks[name]!r}, {name}_2: {path!r}}}"  # quoted: valid YAML for any path
            raise DataError(f"{key}: data files {tasks[name]!r} and {path!r} would both be task {name!r}; name "
                            f"the tasks explicitly with a mapping, e.g. {example}")
        tasks[name] = path
    if not tasks:
        raise DataError(f"{key} lists no files; expected {SPEC_FORMS}")
    return tasks


def _mapping_sources(spec: Mapping[Any, Any], key: str) -> dict[str, str]:
    if not spec:
        raise DataError(f"{key} is an empty mapping; give at least one {{task_name: path}}")
    bad = {k: v for k, v in spec.items() if not isinstance(v, str)}
    if bad:
        raise DataError(f"{key}: tasks {sorted(map(str, bad))} are not a single path (got {bad}); give each task "
                        "one file (or one synthetic:NAME spec), e.g. {gsm8k: data/gsm8k.parquet}")
    return {str(k): v for k, v in spec.items()}


def _task_name(source: str) -> str:
    if source.startswith(SYNTHETIC_PREFIX):
        return parse_synthetic(source)[0]
    return os.path.splitext(os.path.basename(source))[0]


def _rows(source: str) -> tuple[list[dict], str]:
    if not source.startswith(SYNTHETIC_PREFIX):
        return read_rows(source), source
    name, params = parse_synthetic(source)
    if name not in SYNTHETIC_TASKS:
        raise DataError(f"data spec {source!r}: unknown synthetic task {name!r}; registered tasks are "
                        f"{sorted(SYNTHETIC_TASKS) or 'none'}")
    generator = SYNTHETIC_TASKS[name]
    kwargs = {k: _param(source, generator, k, v) for k, v in params.items()}
    try:
        rows = generator(**kwargs)
    except TypeError as exc:  # a required parameter is missing (unknown ones were caught by _param)
        raise DataError(f"data spec {source!r}: synthetic task {name!r} rejected parameters {kwargs}: {exc}; "
                        f"its parameters are {_signature_text(generator)}") from exc
    except ValueError as exc:  # the generator's own check of a parameter's value (its message names it)
        raise DataError(f"data spec {source!r}: bad parameter value: {exc}; fix it in the spec") from exc
    if not rows:
        raise DataError(f"data spec {source!r}: synthetic task {name!r} produced no rows; check its parameters")
    return list(rows), source


def parse_synthetic(spec: str) -> tuple[str, dict[str, str]]:
    """`synthetic:NAME?n=100&hard=true` -> ("NAME", {"n": "100", "hard": "true"}); values are converted later,
    to the types the generator declares (see _param)."""
    name, _, query = spec[len(SYNTHETIC_PREFIX):].partition("?")
    if not name:
        raise DataError(f"data spec {spec!r} has no task name; write synthetic:NAME?key=val&...")
    pairs = parse_qsl(query, keep_blank_values=True)
    seen: dict[str, str] = {}
    for k, v in pairs:
        if k in seen:
            raise DataError(f"data spec {spec!r}: parameter {k!r} is given twice; give it once")
        seen[k] = v
    return name, seen


def _param(source: str, generator: Any, name: str, value: str) -> Any:
    """`value` converted to the type `generator` declares for parameter `name` (annotation, else its default's
    type); a parameter with neither is guessed (bool, int, float, else str)."""
    params = inspect.signature(generator).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if name not in params and not takes_any:
        raise DataError(f"data spec {source!r}: unknown parameter {name!r}; the task's parameters are "
                        f"{_signature_text(generator)}")
    kind = _declared_type(generator, params.get(name))
    if kind is None:
        return _coerce(value)
    try:
        return _convert(kind, value)
    except ValueError as exc:
        raise DataError(f"data spec {source!r}: parameter {name!r} is {value!r}; expected {_KIND_TEXT[kind]}, "
                        f"e.g. {name}={_KIND_EXAMPLE[kind]}") from exc


_KIND_TEXT = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
_KIND_EXAMPLE = {bool: "true", int: "100", float: "0.5", str: "text"}


def _declared_type(generator: Any, param: inspect.Parameter | None) -> type | None:
    if param is None:
        return None
    try:  # annotations are strings under `from __future__ import annotations`; resolve them
        hint = typing.get_type_hints(generator).get(param.name)
    except Exception:  # an unresolvable annotation only loses the check, never the task
        hint = None
    if hint in _KIND_TEXT:
        return hint
    default = param.default
    return type(default) if type(default) in _KIND_TEXT else None


def _convert(kind: type, value: str) -> Any:
    if kind is bool:
        if value.lower() not in ("true", "false", "1", "0"):
            raise ValueError(value)
        return value.lower() in ("true", "1")
    return kind(value)


def _signature_text(generator: Any) -> str:
    """`n, split='train'`: names, with the default of each optional one."""
    params = inspect.signature(generator).parameters.values()
    return ", ".join(p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}" for p in params
                     if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)) or "(none)"


def _coerce(value: str) -> Any:
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value
