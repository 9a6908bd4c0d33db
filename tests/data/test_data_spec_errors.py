"""Data specs as a loaded config holds them (FrozenDict / tuple), and the errors for bad specs, files and
synthetic parameters: each names the key, file, line or parameter and says what was expected."""
from __future__ import annotations

from pathlib import Path

import pytest

import fleetrl.data.tasks  # noqa: F401  (registers synthetic:copy)
from fleetrl.config import load_config
from fleetrl.data import SYNTHETIC_TASKS, DataError, load_dataset, read_rows

QUICKSTART = str(Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml")


def _load(cfg, tokenizer, key: str = "data.train"):
    """What training does with the config's data section (fleetrl/trainer/feed.py)."""
    d = cfg.data
    return load_dataset(d.train, tokenizer, weights=d.weights, key=key, input_key=d.input_key,
                        label_key=d.label_key, default_data_source=d.default_data_source,
                        max_prompt_length=d.max_prompt_length, apply_chat_template=d.apply_chat_template)


@pytest.fixture
def good(tmp_path, jsonl) -> str:
    return jsonl(tmp_path / "good.jsonl", [{"prompt": "what is 1 ?", "answer": "1"}, {"prompt": "2 ?", "answer": "2"}])


@pytest.fixture
def other(tmp_path, jsonl) -> str:
    return jsonl(tmp_path / "other.jsonl", [{"prompt": "3 ?", "answer": "3"}])


def test_mapping_from_a_loaded_config_names_the_tasks(good, other, tokenizer):
    cfg = load_config(QUICKSTART, [f"data.train={{copytask: {good}, more: {other}}}",
                                   "data.weights={copytask: 1, more: 3}"])
    assert not isinstance(cfg.data.train, dict)  # a FrozenDict: the case that used to read keys as paths
    mix = _load(cfg, tokenizer)
    assert mix.sizes == {"copytask": 2, "more": 1}
    assert mix.data_sources == {"copytask", "more"}  # no data_source column: the task name routes the reward
    assert mix.probabilities == {"copytask": 0.25, "more": 0.75}
    assert mix["copytask", 1][0].ground_truth == "2"


def test_list_from_a_loaded_config_names_tasks_by_file(good, other, tokenizer):
    cfg = load_config(QUICKSTART, [f"data.train=[{good}, {other}]"])
    assert isinstance(cfg.data.train, tuple)
    assert _load(cfg, tokenizer).sizes == {"good": 2, "other": 1}


def test_duplicate_file_error_recommends_a_mapping_that_loads(good, tokenizer):
    cfg = load_config(QUICKSTART, [f"data.train=[{good}, {good}]"])
    with pytest.raises(DataError, match=r"data\.train: data files .* would both be task 'good'; name the tasks "
                                        r"explicitly with a mapping, e.g. \{good_1: .*good\.jsonl', good_2:") as err:
        _load(cfg, tokenizer)
    suggestion = str(err.value).partition("e.g. ")[2]
    cfg = load_config(QUICKSTART, [f"data.train={suggestion}"])  # the advice, pasted back as an override
    assert _load(cfg, tokenizer).sizes == {"good_1": 2, "good_2": 2}


@pytest.mark.parametrize("override, match", [
    ("data.train=5", r"data\.train is 5 \(type int\); expected a path \(\.parquet/\.jsonl/\.json\), a list of paths, "
                     r"a \{task_name: path\} mapping, or synthetic:NAME\?key=val"),
    ("data.train=[a.jsonl, 3]", r"data\.train\[1\] is 3 \(type int\); each list entry must be a path"),
    ("data.train={t: [a.jsonl, b.jsonl]}", r"data\.train: tasks \['t'\] are not a single path"),
    ("data.train={}", r"data\.train is an empty mapping"),
    ("data.train=[]", r"data\.train lists no files; expected a path"),
])
def test_spec_of_the_wrong_shape_names_the_key(override, match, tokenizer):
    with pytest.raises(DataError, match=match):
        _load(load_config(QUICKSTART, [override]), tokenizer)


def test_spec_error_without_a_key_names_both_data_keys(tokenizer):
    with pytest.raises(DataError, match=r"^data\.train / data\.val is 5 "):
        load_dataset(5, tokenizer, max_prompt_length=32)  # type: ignore[arg-type]


def test_missing_file_or_directory_names_the_data_keys(tmp_path):
    with pytest.raises(DataError, match=r"nope\.jsonl' does not exist; check the path in data\.train / data\.val"):
        read_rows(str(tmp_path / "nope.jsonl"))
    with pytest.raises(DataError, match=r"is a directory; check the path in data\.train / data\.val"):
        read_rows(str(tmp_path))


def test_non_utf8_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "latin.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n')  # latin-1 e-acute
    with pytest.raises(DataError, match=r"latin\.jsonl': line 2 \(1-based\), byte column 16 is not valid UTF-8 "
                                        r"\(byte 0xe9\); JSON data files must be UTF-8 encoded"):
        read_rows(str(path))


def test_utf8_byte_order_mark_is_accepted(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "caf\xc3\xa9"}\n')
    assert read_rows(str(path)) == [{"prompt": "caf\u00e9"}]


@pytest.mark.parametrize("spec, match", [
    ("synthetic:copy?split=foo", r"'synthetic:copy\?split=foo': bad parameter value: parameter 'split' must be "
                                 r"train or val, got 'foo'"),
    ("synthetic:copy?n=abc", r"'synthetic:copy\?n=abc': parameter 'n' is 'abc'; expected an integer, e\.g\. n=100"),
    ("synthetic:copy?n=1.5", r"parameter 'n' is '1\.5'; expected an integer"),
    ("synthetic:copy?m=1", r"unknown parameter 'm'; the task's parameters are n=512, split='train', seed=0, noise=2"),
    ("synthetic:copy?n=1&n=2", r"parameter 'n' is given twice"),
])
def test_bad_synthetic_parameter_names_spec_and_parameter(spec, match, tokenizer):
    with pytest.raises(DataError, match=match):
        load_dataset(spec, tokenizer, max_prompt_length=32)


def test_synthetic_parameters_take_the_declared_types(tokenizer, monkeypatch):
    seen = {}

    def probe(n: int, label: str = "x", hard: bool = False, scale=1.0) -> list[dict]:
        seen.update(n=n, label=label, hard=hard, scale=scale)
        return [{"prompt": "1 ?", "reward_model": {"ground_truth": "1"}}] * n

    monkeypatch.setitem(SYNTHETIC_TASKS, "probe", probe)
    load_dataset("synthetic:probe?n=2&label=123&hard=1&scale=3", tokenizer, max_prompt_length=32)
    assert seen == {"n": 2, "label": "123", "hard": True, "scale": 3.0}  # label stays a string
    assert type(seen["scale"]) is float
    with pytest.raises(DataError, match=r"parameter 'hard' is 'maybe'; expected true or false"):
        load_dataset("synthetic:probe?n=2&hard=maybe", tokenizer, max_prompt_length=32)
    with pytest.raises(DataError, match=r"task 'probe' rejected parameters \{\}: .*missing .* 'n'; "
                                        r"its parameters are n, label="):
        load_dataset("synthetic:probe", tokenizer, max_prompt_length=32)


@pytest.mark.parametrize("write", ["jsonl", "parquet"])
def test_one_row_without_the_prompt_is_that_rows_fault(tmp_path, tokenizer, write, request):
    # Rows 0 and 2 have `prompt`: data.input_key is right, row 1 is what to fix (parquet gives its cell as None).
    data = [{"prompt": "what is 1 ?", "answer": "1"}, {"answer": "2"}, {"prompt": "3 ?", "answer": "3"}]
    path = request.getfixturevalue(write)(tmp_path / f"gaps.{write}", data)
    cfg = load_config(QUICKSTART, [f"data.train={path}"])
    with pytest.raises(DataError) as info:
        _load(cfg, tokenizer)
    assert str(info.value) == (f"{path}: row 1 (0-based), field 'prompt': this row has no prompt (the other rows of "
                               f"the file have the column). add the prompt to this row or drop the row")


@pytest.mark.parametrize("write, rows, problem", [
    # no row has the column: likely named otherwise (data.input_key)
    ("jsonl", [{"question": "what is 1 ?", "answer": "1"}, {"question": "2 ?", "answer": "2"}],
     "no row has the prompt column 'prompt' (columns present: ['answer', 'question']); set"),
    # parquet keeps the column, null in every row: the file's fault
    ("parquet", [{"prompt": None, "answer": "1"}, {"prompt": None, "answer": "2"}],
     "the prompt column 'prompt' is empty in every row; fill it in, or set"),
], ids=["missing_from_the_whole_file", "null_in_every_row"])
def test_a_prompt_column_no_row_fills_is_the_files_fault(tmp_path, tokenizer, write, rows, problem, request):
    path = request.getfixturevalue(write)(tmp_path / f"q.{write}", rows)
    with pytest.raises(DataError) as info:
        _load(load_config(QUICKSTART, [f"data.train={path}"]), tokenizer)
    assert str(info.value) == f"{path}: {problem} data.input_key to the column that holds the prompt"
