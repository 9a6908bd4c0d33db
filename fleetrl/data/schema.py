"""Normalising one raw row (verl or OpenRLHF schema) into a PromptRecord.

verl schema: `data_source`, `prompt` (list of {role, content}), `ability`, `reward_model` ({ground_truth,
style}), `extra_info` (dict). OpenRLHF schema: `input_key` names a column holding a plain string or a chat
list, `label_key` the ground-truth column. Nested columns are accepted in every shape they arrive in from
real files: real dicts/lists, numpy arrays of dicts (pandas-read parquet), JSON strings, and Python-literal
strings (`str(dict)` written by scripts, e.g. "{'ground_truth': '42'}").
"""
from __future__ import annotations

import ast
import json
import math
from functools import partial
from typing import Any, Callable

import numpy as np

from fleetrl.data.errors import DataError, row_error
from fleetrl.data.records import PromptRecord

# Where the ground truth is looked for when no label_key is given, in order.
GROUND_TRUTH_KEYS = ("reward_model.ground_truth", "ground_truth", "answer")

_ErrFn = Callable[[str, str, str], DataError]


def normalise_row(raw: dict, *, file: str, row: int, input_key: str = "prompt", label_key: str | None = None,
                  default_data_source: str | None = None, column_in_file: bool = False) -> PromptRecord:
    """Validates and converts one raw row; every problem raises DataError naming file, row and field.
    `column_in_file`: other rows of the file hold `input_key` (check_input_column passed), so a row without it is
    that row's fault, not data.input_key's."""
    err: _ErrFn = partial(row_error, file, row)
    messages, text = _prompt(raw, input_key, err, column_in_file)
    reward_model = _as_dict(raw.get("reward_model"), "reward_model", err)
    return PromptRecord(
        messages=messages,
        text=text,
        data_source=_data_source(raw.get("data_source"), default_data_source, err),
        ability=_optional_str(raw.get("ability"), "ability", err),
        ground_truth=_ground_truth(raw, reward_model, label_key, err),
        extra_info=_as_dict(raw.get("extra_info"), "extra_info", err),
        source_file=file,
        row=row,
    )


# ------------------------------------------------------------------------------------------- value decoding
def _to_python(value: Any) -> Any:
    """numpy arrays/scalars (what pandas gives for parquet list/struct columns) -> plain lists/dicts/scalars."""
    if isinstance(value, np.ndarray):
        return [_to_python(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {k: _to_python(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_python(v) for v in value]
    return value


def _is_missing(value: Any) -> bool:
    # pandas writes a missing cell as NaN, pyarrow as None.
    return value is None or (isinstance(value, float) and math.isnan(value))


def _parse_literal(text: str) -> Any:
    """JSON first (the common case, and stricter), then a Python literal; None when neither parses."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None


def _as_dict(value: Any, field: str, err: _ErrFn) -> dict:
    if _is_missing(value):
        return {}
    value = _to_python(value)
    if isinstance(value, str):
        parsed = _parse_literal(value) if value.strip() else {}
        if not isinstance(parsed, dict):
            raise err(field, f"got a string that is neither a JSON object nor a Python dict literal: "
                             f"{value[:80]!r}", "store it as a dict/struct column, a JSON object string "
                                                "or a Python dict literal")
        value = parsed
    if not isinstance(value, dict):
        raise err(field, f"expected a dict, got {type(value).__name__}", "store it as a dict/struct column")
    return value


# ---------------------------------------------------------------------------------------------- the fields
def check_input_column(rows: list[dict], file: str, input_key: str) -> None:
    """A prompt column that no row of the file fills is data.input_key's fault (or the file's), not one row's:
    said once, for the file, before the rows are normalised."""
    if any(not _is_missing(r.get(input_key)) for r in rows):
        return
    if any(input_key in r for r in rows):  # parquet: the column exists, every cell is null
        raise DataError(f"{file}: the prompt column {input_key!r} is empty in every row; fill it in, or set "
                        f"data.input_key to the column that holds the prompt")
    columns = sorted({str(k) for r in rows for k in r})
    raise DataError(f"{file}: no row has the prompt column {input_key!r} (columns present: {columns}); set "
                    f"data.input_key to the column that holds the prompt")


def _prompt(raw: dict, key: str, err: _ErrFn,
            column_in_file: bool = False) -> tuple[tuple[dict[str, str], ...] | None, str | None]:
    """(messages, None) for a chat prompt, (None, text) for a plain-text prompt."""
    if _is_missing(raw.get(key)):
        if key not in raw and not column_in_file:  # a row on its own: the column may be named otherwise
            raise err(key, f"column is missing (columns present: {sorted(raw)})",
                      "set data.input_key to the column that holds the prompt")
        # A jsonl row without the key, or parquet's null cell, in a file whose other rows have the prompt.
        why = "the other rows of the file have the column" if column_in_file else "its cell is empty"
        raise err(key, f"this row has no prompt ({why})", "add the prompt to this row or drop the row")
    value = _to_python(raw[key])
    if isinstance(value, str):
        # A chat list may arrive serialised; anything else that is a string is a plain-text prompt
        # (a text prompt may legitimately start with '[', e.g. "[INST] ...").
        parsed = _parse_literal(value) if value.lstrip().startswith("[") else None
        if not (isinstance(parsed, list) and parsed and all(isinstance(m, dict) for m in parsed)):
            if not value.strip():
                raise err(key, "the prompt is an empty string", "drop the row or fill in the prompt")
            return None, value
        value = parsed
    if isinstance(value, list) and value:
        return tuple(_message(m, f"{key}[{j}]", err) for j, m in enumerate(value)), None
    raise err(key, f"expected a string or a non-empty list of chat messages {{'role': ..., 'content': ...}}, "
                   f"got {type(value).__name__} {str(value)[:80]!r}",
              "write the prompt as text or as [{'role': 'user', 'content': '...'}]")


def _message(message: Any, field: str, err: _ErrFn) -> dict[str, str]:
    if not isinstance(message, dict):
        raise err(field, f"a chat message must be a dict, got {type(message).__name__}",
                  "write each message as {'role': 'user', 'content': '...'}")
    for part in ("role", "content"):
        value = message.get(part)
        if not isinstance(value, str) or (part == "role" and not value):
            found = "missing" if value is None else f"{type(value).__name__} {str(value)[:40]!r}"
            raise err(f"{field}.{part}", f"expected a string {part}, found {found}",
                      "every message needs a 'role' (system/user/assistant) and a 'content' string")
    # Parquet struct columns add every key seen in any row, filled with None; drop those.
    return {k: v for k, v in message.items() if v is not None}


def _data_source(value: Any, default: str | None, err: _ErrFn) -> str:
    if _is_missing(value) or (isinstance(value, str) and not value):
        if default is None:
            raise err("data_source", "missing and no default is set",
                      "add a data_source column, set data.default_data_source, or name the task "
                      "({task_name: path}) in the data config")
        return default
    if not isinstance(value, str):
        raise err("data_source", f"expected a string, got {type(value).__name__}", "store it as a string column")
    return value


def _optional_str(value: Any, field: str, err: _ErrFn) -> str | None:
    if _is_missing(value):
        return None
    if not isinstance(value, str):
        raise err(field, f"expected a string, got {type(value).__name__}", "store it as a string column")
    return value


def _ground_truth(raw: dict, reward_model: dict, label_key: str | None, err: _ErrFn) -> Any:
    if label_key is not None:
        if label_key not in raw or _is_missing(raw[label_key]):
            found = "missing" if label_key not in raw else "empty"
            raise err(label_key, f"label column is {found} (columns present: {sorted(raw)})",
                      "set data.label_key to the column that holds the answer, or unset it to use "
                      "reward_model.ground_truth")
        return _to_python(raw[label_key])
    if not _is_missing(reward_model.get("ground_truth")):
        return _to_python(reward_model["ground_truth"])
    for key in GROUND_TRUTH_KEYS[1:]:
        if not _is_missing(raw.get(key)):
            return _to_python(raw[key])
    raise err("reward_model.ground_truth", f"no ground truth found; looked for {list(GROUND_TRUTH_KEYS)} "
                                           f"(columns present: {sorted(raw)})",
              "add one of these, or set data.label_key to the column that holds the answer")
