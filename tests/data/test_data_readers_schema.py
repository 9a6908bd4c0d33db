"""read_rows and normalise_row on hand-written verl / OpenRLHF files."""
from __future__ import annotations

import json

import numpy as np
import pytest

from fleetrl.data import DataError, normalise_row, read_rows


def test_parquet_and_jsonl_read_the_same_rows(tmp_path, rows, jsonl, parquet):
    data = [rows(i) for i in range(3)]
    for path in (parquet(tmp_path / "a.parquet", data), jsonl(tmp_path / "a.jsonl", data)):
        got = read_rows(path)
        assert [r["reward_model"]["ground_truth"] for r in got] == ["42"] * 3
        assert got[2]["prompt"][0]["content"] == "what is 2 + 1 ?"


def test_json_array_file(tmp_path):
    path = tmp_path / "a.json"
    path.write_text(json.dumps([{"prompt": "hi", "answer": "1"}]))
    assert read_rows(str(path)) == [{"prompt": "hi", "answer": "1"}]


def test_bad_json_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": oops}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl.*line 3 \(1-based"):
        read_rows(str(path))


@pytest.mark.parametrize("name, match", [("data.csv", "unknown extension '.csv'"), ("missing.jsonl", "does not exist")])
def test_unreadable_files(tmp_path, name, match):
    if name.endswith(".csv"):
        (tmp_path / name).write_text("a,b\n")
    with pytest.raises(DataError, match=match):
        read_rows(str(tmp_path / name))


# The same verl row with its nested columns in each shape they arrive in from real files.
AS_JSON = {"prompt": json.dumps([{"role": "user", "content": "q"}]),
           "reward_model": json.dumps({"ground_truth": "42"}), "extra_info": json.dumps({"k": 1})}
AS_LITERAL = {"prompt": str([{"role": "user", "content": "q"}]), "reward_model": "{'ground_truth': '42'}",
              "extra_info": "{'k': 1}"}
AS_NUMPY = {"prompt": np.array([{"role": "user", "content": "q"}], dtype=object),
            "reward_model": {"ground_truth": np.str_("42")}, "extra_info": {"k": np.int64(1)}}
AS_DICT = {"prompt": [{"role": "user", "content": "q"}], "reward_model": {"ground_truth": "42"}, "extra_info": {"k": 1}}


@pytest.mark.parametrize("columns", [AS_DICT, AS_JSON, AS_LITERAL, AS_NUMPY], ids=["dict", "json", "literal", "numpy"])
def test_verl_nested_columns_in_every_shape(columns):
    rec = normalise_row({"data_source": "gsm8k", "ability": "math", **columns}, file="f.parquet", row=7)
    assert rec.messages == ({"role": "user", "content": "q"},) and rec.text is None
    assert rec.ground_truth == "42" and rec.extra_info == {"k": 1}
    assert type(rec.extra_info["k"]) is int
    assert (rec.data_source, rec.ability, rec.uid) == ("gsm8k", "math", "f.parquet:7")


def test_openrlhf_text_prompt_with_label_key():
    rec = normalise_row({"question": "[INST] what is 2 [/INST]", "label": 2}, file="f.jsonl", row=0,
                        input_key="question", label_key="label", default_data_source="mine")
    assert rec.text == "[INST] what is 2 [/INST]" and rec.messages is None
    assert (rec.ground_truth, rec.data_source) == (2, "mine")


def test_openrlhf_chat_list_and_answer_column():
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    rec = normalise_row({"data_source": "x", "input": messages, "answer": "7"}, file="f.jsonl", row=0,
                        input_key="input")
    assert [m["role"] for m in rec.messages] == ["system", "user"] and rec.ground_truth == "7"


def test_parquet_round_trip_drops_struct_fill_values(tmp_path, parquet):
    # pyarrow gives every message the union of keys; the missing ones come back as None and are dropped.
    data = [{"data_source": "s", "prompt": [{"role": "user", "content": "a", "name": "bob"}], "answer": "1"},
            {"data_source": "s", "prompt": [{"role": "user", "content": "b"}], "answer": "2"}]
    raw = read_rows(parquet(tmp_path / "p.parquet", data))
    rec = normalise_row(raw[1], file="p.parquet", row=1)
    assert rec.messages == ({"role": "user", "content": "b"},)


@pytest.mark.parametrize("raw, field", [
    ({"data_source": "s", "prompt": [{"role": "user"}], "answer": "1"}, "prompt[0].content"),
    ({"data_source": "s", "prompt": [{"content": "x"}], "answer": "1"}, "prompt[0].role"),
    ({"data_source": "s", "prompt": 5, "answer": "1"}, "prompt"),
    ({"data_source": "s", "prompt": [], "answer": "1"}, "prompt"),
    ({"prompt": "hi", "answer": "1"}, "data_source"),
    ({"data_source": "s", "prompt": "hi", "answer": "1", "extra_info": "not a dict"}, "extra_info"),
    ({"data_source": "s", "prompt": "hi", "answer": "1", "reward_model": [1]}, "reward_model"),
])
def test_malformed_rows_name_file_row_and_field(raw, field):
    with pytest.raises(DataError) as info:
        normalise_row(raw, file="train.jsonl", row=3)
    message = str(info.value)
    assert "train.jsonl" in message and "row 3 (0-based)" in message and repr(field) in message


def test_missing_prompt_column_lists_columns_and_setting():
    expected = r"row 0 \(0-based\), field 'question': column is missing .*'prompt'.*data.input_key"
    with pytest.raises(DataError, match=expected):
        normalise_row({"prompt": "hi", "answer": "1", "data_source": "s"}, file="f.jsonl", row=0, input_key="question")


def test_missing_ground_truth_lists_the_keys_looked_for():
    with pytest.raises(DataError) as info:
        normalise_row({"data_source": "s", "prompt": "hi", "reward_model": {"style": "rule"}}, file="f.jsonl", row=3)
    message = str(info.value)
    for key in ("reward_model.ground_truth", "'ground_truth'", "'answer'", "data.label_key", "row 3"):
        assert key in message


def test_missing_label_key_column():
    with pytest.raises(DataError, match=r"field 'label': label column is missing"):
        normalise_row({"data_source": "s", "prompt": "hi", "answer": "1"}, file="f", row=0, label_key="label")
