"""fleetrl data make: reasoning-gym tasks and GSM8K JSONL -> verl parquet that fleetrl's own reader loads."""
from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from fleetrl.cli.main import app
from fleetrl.data import DataError, load_dataset, read_rows
from fleetrl.data.make import SYSTEM_PROMPTS, make_data, parse_options
from fleetrl.rewards import RewardRouter, resolve_scorer

VERL_COLUMNS = {"data_source", "prompt", "ability", "reward_model", "extra_info"}


def _expression_value(question: str) -> int:
    # chain_sum questions end with "<a> +/- <b> ... =": evaluate the expression by hand-rolled left fold.
    tokens = question.rsplit(":", 1)[1].rstrip(" =").split()
    total = int(tokens[0])
    for op, num in zip(tokens[1::2], tokens[2::2]):
        total = total + int(num) if op == "+" else total - int(num)
    return total


def test_reasoning_gym_task_reads_back_through_fleetrl(tmp_path, tokenizer):
    made = make_data("chain_sum", tmp_path, n_train=6, n_val=3, seed=1, options={"max_terms": 2, "max_digits": 2})
    assert (made.num_train, made.num_val, made.answer_format) == (6, 3, "gsm8k")
    assert made.data_source == "gsm8k/reasoning_gym/chain_sum"
    train, val = read_rows(str(made.train)), read_rows(str(made.val))
    assert set(train[0]) == VERL_COLUMNS and len(train) == 6 and len(val) == 3
    for row in train + val:
        system, user = row["prompt"]
        assert system == {"role": "system", "content": SYSTEM_PROMPTS["gsm8k"]} and user["role"] == "user"
        assert row["reward_model"]["style"] == "rule"
        assert row["reward_model"]["ground_truth"] == str(_expression_value(user["content"]))
    assert not {r["prompt"][1]["content"] for r in train} & {r["prompt"][1]["content"] for r in val}
    assert [r["extra_info"]["split"] for r in val] == ["val"] * 3 and val[2]["extra_info"]["index"] == 2
    # fleetrl's own loader takes it as is, and the reward registry routes it with no config.
    data = load_dataset({"arith": str(made.train)}, tokenizer, max_prompt_length=512, apply_chat_template=False)
    assert len(data) == 6 and data.data_sources == {made.data_source}
    assert RewardRouter({}).spec_for(made.data_source) == "gsm8k"


def test_same_seed_same_rows_other_seed_other_rows(tmp_path):
    a = read_rows(str(make_data("chain_sum", tmp_path / "a", n_train=4, n_val=0, seed=3).train))
    b = read_rows(str(make_data("chain_sum", tmp_path / "b", n_train=4, n_val=0, seed=3).train))
    c = read_rows(str(make_data("chain_sum", tmp_path / "c", n_train=4, n_val=0, seed=4).train))
    assert a == b and a != c and not (tmp_path / "a" / "val.parquet").exists()


def test_non_numeric_answers_use_boxed_and_the_math_scorer(tmp_path):
    made = make_data("spell_backward", tmp_path, n_train=3, n_val=1, seed=0)
    assert made.answer_format == "boxed" and made.data_source == "math/reasoning_gym/spell_backward"
    row = read_rows(str(made.train))[0]
    assert "\\boxed{}" in row["prompt"][0]["content"]
    truth = row["reward_model"]["ground_truth"]
    scorer = resolve_scorer(RewardRouter({}).spec_for(made.data_source))
    assert scorer(f"So the answer is \\boxed{{{truth}}}", truth, {}) == 1.0


GSM_ROWS = [  # question, answer; ground truths after '####' with thousands commas dropped
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=7\n#### 7"},
    {"question": "A farm has 1,000 hens and sells none.", "answer": "No change.\n#### 1,000"},
    {"question": "What is 9 minus 12?", "answer": "9-12=-3\n#### -3"},
    {"question": "Half of 5?", "answer": "5/2=2.5\n#### 2.5"},
    {"question": "Eight times nine?", "answer": "8*9=72 #### 72"},
]


def _write_gsm(path, rows, extra_lines=()):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "".join(extra_lines))
    return str(path)


def test_gsm8k_jsonl(tmp_path):
    src = _write_gsm(tmp_path / "mygsm.jsonl", GSM_ROWS)
    made = make_data(f"gsm8k:{src}", tmp_path / "out", n_train=10, n_val=2, seed=0)
    assert (made.num_train, made.num_val) == (3, 2) and made.data_source == "gsm8k/jsonl/mygsm"
    rows = read_rows(str(made.train)) + read_rows(str(made.val))
    by_question = {r["prompt"][1]["content"]: r["reward_model"]["ground_truth"] for r in rows}
    assert by_question == {r["question"]: t for r, t in zip(GSM_ROWS, ["7", "1000", "-3", "2.5", "72"])}
    eight_nine = next(r for r in rows if r["reward_model"]["ground_truth"] == "72")
    assert json.loads(eight_nine["extra_info"]["details"]) == {"solution": "8*9=72", "line": 5}
    scorer = resolve_scorer(RewardRouter({}).spec_for(made.data_source))
    assert scorer("so #### 1000", "1000", {}) == 1.0 and scorer("#### 999", "1000", {}) == 0.0


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    src = _write_gsm(tmp_path / "broken.jsonl", GSM_ROWS[:2], ['{"question": "x", "answer": oops}\n'])
    with pytest.raises(DataError, match=r"broken\.jsonl: line 3 \(1-based\): not valid JSON"):
        make_data(f"gsm8k:{src}", tmp_path / "out")
    src = _write_gsm(tmp_path / "nomark.jsonl", GSM_ROWS[:1] + [{"question": "q", "answer": "just 5"}])
    with pytest.raises(DataError, match=r"nomark\.jsonl: line 2 \(1-based\): field 'answer' has no final answer"):
        make_data(f"gsm8k:{src}", tmp_path / "out")
    src = _write_gsm(tmp_path / "keys.jsonl", [{"q": "x", "a": "#### 1"}])
    with pytest.raises(DataError, match=r"keys\.jsonl: line 1 .*'question' and 'answer', found \['a', 'q'\]"):
        make_data(f"gsm8k:{src}", tmp_path / "out")


def test_unknown_task_lists_known_ones_with_did_you_mean(tmp_path):
    with pytest.raises(DataError, match="unknown task 'basic_arithmetc'. Did you mean 'basic_arithmetic'") as err:
        make_data("basic_arithmetc", tmp_path)
    assert "gsm8k:PATH.jsonl" in str(err.value) and "gsm_symbolic" in str(err.value)
    with pytest.raises(DataError, match=r"rejected options \{'max_termz': 2\}"):
        make_data("chain_sum", tmp_path, options={"max_termz": 2})


def test_a_task_too_small_for_its_held_out_set_is_refused_not_silently_short(tmp_path):
    # one-digit a + b has 10 x 10 distinct questions at most: 500 training rows see them all, so no question is
    # left to hold out; the run would otherwise start with no validation file
    with pytest.raises(DataError, match=r"only 0 of the --n-val 20 validation questions .* lower --n-train"):
        make_data("basic_arithmetic", tmp_path, n_train=500, n_val=20, seed=0,
                  options={"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+"],
                           "allow_parentheses": False, "allow_negation": False})
    assert not (tmp_path / "train.parquet").exists()  # nothing half-written


def test_parse_options():
    assert parse_options(["max_terms=2", "operators=+,-", "allow_negation=false", 'ops=["*"]']) == {
        "max_terms": 2, "operators": ["+", "-"], "allow_negation": False, "ops": ["*"]}
    with pytest.raises(DataError, match="'max_terms' is not KEY=VALUE"):
        parse_options(["max_terms"])


def test_cli_make_and_its_errors(tmp_path):
    runner = CliRunner()
    src = _write_gsm(tmp_path / "g.jsonl", GSM_ROWS)
    r = runner.invoke(app, ["data", "make", f"gsm8k:{src}", "--out", str(tmp_path / "o"), "--n-val", "1"])
    assert r.exit_code == 0, r.output
    assert re.search(r"train\.parquet \(4 rows\).*val\.parquet \(1 rows\)", r.output.replace("\n", ""))
    r = runner.invoke(app, ["data", "make", "chain_sun", "--out", str(tmp_path / "x")])
    assert r.exit_code == 2 and "Did you mean 'chain_sum'" in r.output
