"""Reading prompt files into plain row dicts: parquet, JSON lines, or a JSON array."""
from __future__ import annotations

import codecs
import json
import os

from fleetrl.data.errors import DataError

PARQUET_EXTS = (".parquet",)
JSON_EXTS = (".jsonl", ".json")


def read_rows(path: str) -> list[dict]:
    """Reads every row of `path` as a dict of column -> Python value.

    `.parquet` is read with pyarrow; `.jsonl` / `.json` hold one JSON object per line (blank lines are
    skipped). A `.json` file whose first character is `[` is read as one JSON array of objects instead,
    since that is what most tools write under that extension.
    """
    if not os.path.isfile(path):
        where = "is a directory" if os.path.isdir(path) else "does not exist"
        raise DataError(f"data file {path!r} {where}; check the path in data.train / data.val "
                        f"(relative paths are resolved from {os.getcwd()!r})")
    ext = os.path.splitext(path)[1].lower()
    if ext in PARQUET_EXTS:
        rows = _read_parquet(path)
    elif ext in JSON_EXTS:
        rows = _read_json(path)
    else:
        raise DataError(f"data file {path!r}: unknown extension {ext or '(none)'!r}; expected one of "
                        f"{list(PARQUET_EXTS + JSON_EXTS)}. Convert the file or rename it if it already is "
                        "one of these formats")
    if not rows:
        raise DataError(f"data file {path!r} has no rows; point the data config at a non-empty file")
    return rows


def _read_parquet(path: str) -> list[dict]:
    import pyarrow.parquet as pq  # imported lazily: only parquet users pay for pyarrow's import time

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several unrelated types for a corrupt file
        raise DataError(f"data file {path!r} is not a readable parquet file: {exc}") from exc
    # to_pylist turns struct/list columns into dicts/lists (not numpy arrays as pandas would).
    return table.to_pylist()


def _read_json(path: str) -> list[dict]:
    text = _read_utf8(path)
    if path.lower().endswith(".json") and text.lstrip().startswith("["):
        return _read_json_array(path, text)
    rows = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"data file {path!r}: line {lineno} (1-based, as editors count) is not valid JSON "
                            f"({exc.msg} at column {exc.colno}); each line must hold one JSON object") from exc
        if not isinstance(obj, dict):
            raise DataError(f"data file {path!r}: line {lineno} (1-based) holds a JSON {type(obj).__name__}; "
                            "each line must hold one JSON object like {\"prompt\": ..., ...}")
        rows.append(obj)
    return rows


def _read_utf8(path: str) -> str:
    with open(path, "rb") as f:
        data = f.read()
    # Tools on Windows often write a UTF-8 byte-order mark; it is not part of the JSON, so it is dropped.
    data = data.removeprefix(codecs.BOM_UTF8)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise DataError(f"data file {path!r}: line {line} (1-based), byte column {column} is not valid UTF-8 "
                        f"(byte 0x{data[exc.start]:02x}); JSON data files must be UTF-8 encoded. Re-save the file "
                        "as UTF-8 (e.g. `iconv -f latin1 -t utf-8 in.jsonl > out.jsonl`)") from exc


def _read_json_array(path: str, text: str) -> list[dict]:
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(f"data file {path!r}: invalid JSON at line {exc.lineno} (1-based), column {exc.colno}: "
                        f"{exc.msg}") from exc
    for i, obj in enumerate(rows):
        if not isinstance(obj, dict):
            raise DataError(f"data file {path!r}: element {i} (0-based) of the JSON array is a "
                            f"{type(obj).__name__}; every element must be an object")
    return rows
