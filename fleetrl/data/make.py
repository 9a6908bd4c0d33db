"""`fleetrl data make`: verl-format parquet made offline from reasoning-gym tasks or a GSM8K-format JSONL file.

Every row written:
  data_source    `<scorer>/<origin>/<task>`, e.g. `gsm8k/reasoning_gym/basic_arithmetic`. The first part names
                 the builtin scorer the reward registry routes it to by family (fleetrl/rewards/registry.py:
                 a data_source containing "gsm8k" -> `gsm8k`, containing "math" -> `math`), so the made data
                 trains with no `rewards:` section.
  prompt         [{role: system, content: <answer-format instruction>}, {role: user, content: <question>}]
  ability        "math" for numeric answers, "reasoning" otherwise
  reward_model   {style: "rule", ground_truth: <answer string>}
  extra_info     {split, index, task, origin, ...}: reasoning-gym metadata as JSON / the GSM8K solution

Numeric answers use the `gsm8k` scorer (the number after the last `####`, else the last number in the reply),
others `\\boxed{}` with the `math` scorer (normalised string or exact value match).
"""
from __future__ import annotations

import difflib
import json
import random
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from fleetrl.data.errors import DataError

GSM8K_PREFIX = "gsm8k:"
FORMATS = ("auto", "gsm8k", "boxed")
# The system turn tells the model the exact answer format its scorer parses.
SYSTEM_PROMPTS = {
    "gsm8k": "Solve the problem. End your reply with '#### ' followed by the final number, e.g. '#### 42'.",
    "boxed": "Solve the problem. End your reply with the final answer in \\boxed{}, e.g. \\boxed{42}.",
}
SCORER_OF_FORMAT = {"gsm8k": "gsm8k", "boxed": "math"}
_NUMBER = re.compile(r"^-?\d+(?:\.\d+)?(?:/\d+)?$")


@dataclass(frozen=True, kw_only=True, slots=True)
class MadeData:
    train: Path
    val: Path | None
    num_train: int
    num_val: int
    data_source: str
    answer_format: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Example:
    question: str
    answer: str
    extra: dict[str, Any]


def make_data(task: str, out_dir: str | Path, *, n_train: int = 1000, n_val: int = 200, seed: int = 0,
              answer_format: str = "auto", options: dict[str, Any] | None = None) -> MadeData:
    """Writes OUT/train.parquet (and OUT/val.parquet when n_val > 0) for `task`; see the module docstring.

    `task`: a reasoning-gym dataset name (`basic_arithmetic`, `gsm_symbolic`, ...) or `gsm8k:PATH.jsonl`.
    `options`: reasoning-gym config fields (e.g. {"max_terms": 2}); rejected for JSONL input.
    """
    if n_train < 1 or n_val < 0:
        raise DataError(f"data make: need --n-train >= 1 and --n-val >= 0, got {n_train} and {n_val}")
    if answer_format not in FORMATS:
        raise DataError(f"data make: --format {answer_format!r} is not one of {FORMATS}")
    if task.startswith(GSM8K_PREFIX):
        if options:
            raise DataError(f"data make: options {sorted(options)} only apply to reasoning-gym tasks, not {task!r}")
        origin, name = "jsonl", Path(task[len(GSM8K_PREFIX):]).stem
        train, val = _split(read_gsm8k_jsonl(task[len(GSM8K_PREFIX):]), n_train, n_val, seed, task)
    else:
        origin, name = "reasoning_gym", task
        train, val = _reasoning_gym(task, n_train, n_val, seed, options or {})
    fmt = _choose_format(answer_format, train + val)
    source = f"{SCORER_OF_FORMAT[fmt]}/{origin}/{name}"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write(out / "train.parquet", train, "train", source, fmt, name, origin)
    if val:
        _write(out / "val.parquet", val, "val", source, fmt, name, origin)
    return MadeData(train=out / "train.parquet", val=out / "val.parquet" if val else None, num_train=len(train),
                    num_val=len(val), data_source=source, answer_format=fmt)


def parse_options(items: Iterable[str]) -> dict[str, Any]:
    """["max_terms=2", "operators=+,-"] -> {"max_terms": 2, "operators": ["+", "-"]} (JSON values also work)."""
    options: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise DataError(f"data make: option {item!r} is not KEY=VALUE (e.g. -o max_terms=2)")
        options[key.strip()] = _option_value(value.strip())
    return options


def _option_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        pass
    if "," in text:
        return [_option_value(part.strip()) for part in text.split(",")]
    return {"true": True, "false": False}.get(text.lower(), text)


# ------------------------------------------------------------------------------------------------- sources
def read_gsm8k_jsonl(path: str) -> list[Example]:
    """GSM8K rows {"question": ..., "answer": "<solution> #### 72"}; errors name the file and the line."""
    file = Path(path)
    if not file.is_file():
        raise DataError(f"data make: GSM8K file {path!r} does not exist; write gsm8k:PATH/TO/FILE.jsonl")
    examples = []
    with file.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if line.strip():
                examples.append(_gsm8k_example(line, path, lineno))
    if not examples:
        raise DataError(f"data make: {path} has no rows; expected JSON lines with 'question' and 'answer'")
    return examples


def _gsm8k_example(line: str, path: str, lineno: int) -> Example:
    where = f"{path}: line {lineno} (1-based)"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno}); each line must be one "
                        'object like {"question": "...", "answer": "... #### 72"}') from None
    if not isinstance(row, dict) or not isinstance(row.get("question"), str) or not isinstance(row.get("answer"), str):
        keys = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise DataError(f"{where}: expected string fields 'question' and 'answer', found {keys}")
    solution, marker, final = row["answer"].rpartition("####")
    if not marker or not final.strip():
        raise DataError(f"{where}: field 'answer' has no final answer after '####' (GSM8K writes "
                        f"'... #### 72'); got {row['answer'][-60:]!r}")
    return Example(question=row["question"].strip(), answer=final.strip().replace(",", ""),
                   extra={"solution": solution.strip(), "line": lineno})


def _reasoning_gym(task: str, n_train: int, n_val: int, seed: int,
                   options: dict[str, Any]) -> tuple[list[Example], list[Example]]:
    try:
        import reasoning_gym
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise DataError("data make: reasoning-gym tasks need the `reasoning-gym` package: pip install "
                        "reasoning-gym") from None
    if task not in DATASETS:
        raise DataError(unknown_task_message(task, sorted(DATASETS)))
    try:
        # Oversample so that dropping validation questions already in train still leaves n_val of them.
        dataset = reasoning_gym.create_dataset(task, size=n_train + 2 * n_val, seed=seed, **options)
    except (TypeError, ValueError, AssertionError) as exc:
        raise DataError(f"data make: reasoning-gym task {task!r} rejected options {options}: {exc}") from None
    examples = [Example(question=str(x["question"]), answer=str(x["answer"]).strip(),
                        extra={"metadata": x.get("metadata", {})}) for x in dataset]
    train = examples[:n_train]
    seen = {e.question for e in train}
    val = [e for e in examples[n_train:] if e.question not in seen][:n_val]
    if len(val) < n_val:
        # A small task (e.g. one-digit sums: ~240 distinct questions) runs out of questions training has not seen.
        raise DataError(f"data make: only {len(val)} of the --n-val {n_val} validation questions of {task!r} differ "
                        f"from the {len(seen)} distinct training ones (the task has few distinct questions); "
                        "lower --n-train or --n-val, or widen the task's options")
    return train, val


def unknown_task_message(task: str, known: Iterable[str]) -> str:
    known = list(known)
    close = difflib.get_close_matches(task, known, n=3, cutoff=0.6)
    hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
    return (f"data make: unknown task {task!r}.{hint} Known tasks: {GSM8K_PREFIX}PATH.jsonl (a GSM8K-format file) "
            f"and the reasoning-gym datasets {', '.join(known)}")


def _split(examples: list[Example], n_train: int, n_val: int, seed: int,
           task: str) -> tuple[list[Example], list[Example]]:
    """Shuffled with `seed`; the first n_val rows validate, up to n_train of the rest train."""
    if len(examples) <= n_val:
        raise DataError(f"data make: {task} has {len(examples)} rows, not enough for --n-val {n_val} plus at "
                        "least one training row; lower --n-val")
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    shuffled = [examples[i] for i in order]
    return shuffled[n_val:n_val + n_train], shuffled[:n_val]


# ------------------------------------------------------------------------------------------------- writing
def _choose_format(requested: str, examples: list[Example]) -> str:
    if requested != "auto":
        return requested
    return "gsm8k" if all(_NUMBER.match(e.answer) for e in examples) else "boxed"


def _write(path: Path, examples: list[Example], split: str, source: str, fmt: str, task: str, origin: str) -> None:
    ability = "math" if fmt == "gsm8k" else "reasoning"
    rows = [{"data_source": source,
             "prompt": [{"role": "system", "content": SYSTEM_PROMPTS[fmt]}, {"role": "user", "content": e.question}],
             "ability": ability,
             "reward_model": {"style": "rule", "ground_truth": e.answer},
             "extra_info": {"split": split, "index": i, "task": task, "origin": origin,
                            "details": json.dumps(e.extra, default=str)}}
            for i, e in enumerate(examples)]
    tmp = path.with_suffix(".parquet.tmp")
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    tmp.replace(path)  # a half-written file never carries the final name
