import json

import pytest

from fleetrl.envs.tool_env import ToolEnv, lookup_env
from fleetrl.envs.tools import (
    TOOLS,
    HermesFormat,
    ToolCall,
    ToolCallError,
    ToolError,
    WordsFormat,
    calc,
    validate_call,
)


def hermes(obj) -> str:
    return f"<tool_call>{json.dumps(obj)}</tool_call>"


def test_hermes_parses_calls_and_final_answers():
    fmt = HermesFormat()
    text = "let me compute " + hermes({"name": "calc", "arguments": {"expr": "2*3"}})
    assert fmt.parse(text) == [ToolCall("calc", {"expr": "2*3"})]
    assert fmt.parse("the answer is 6") == []
    two = hermes({"name": "calc", "arguments": {"expr": "1"}}) + hermes({"name": "calc", "arguments": {"expr": "2"}})
    assert [c.arguments["expr"] for c in fmt.parse(two)] == ["1", "2"]


@pytest.mark.parametrize(("text", "message"), [
    ("<tool_call>{'name': 'calc'}</tool_call>", "not valid JSON"),
    ('<tool_call>{"name": "calc", "arguments": {"expr": "1"}}', "unbalanced"),
    ('<tool_call>{"name": "calc"}</tool_call>', "nothing else"),
    ('<tool_call>{"name": "calc", "arguments": {}, "id": 1}</tool_call>', "nothing else"),
    ('<tool_call>{"name": 3, "arguments": {}}</tool_call>', "name must be a string"),
    ('<tool_call>["calc"]</tool_call>', "nothing else"),
])
def test_hermes_rejects_malformed_calls(text, message):
    with pytest.raises(ToolCallError, match=message):
        HermesFormat().parse(text)


def test_validate_call_checks_tool_names_argument_names_and_types():
    assert validate_call(ToolCall("calc", {"expr": "1+1"}), TOOLS).name == "calc"
    with pytest.raises(ToolCallError, match="unknown tool 'search'"):
        validate_call(ToolCall("search", {"q": "x"}), TOOLS)
    with pytest.raises(ToolCallError, match=r"takes arguments \['expr'\], got \['expression'\]"):
        validate_call(ToolCall("calc", {"expression": "1"}), TOOLS)
    with pytest.raises(ToolCallError, match="calc.expr must be a str, got int"):
        validate_call(ToolCall("calc", {"expr": 12}), TOOLS)


def test_words_format_is_strict():
    fmt = WordsFormat("?", "lookup", ("key",))
    assert fmt.parse("? q") == [ToolCall("lookup", {"key": "q"})]
    assert fmt.parse("7") == []
    for bad in ("? q r", "q ?", "? ? q", "?"):
        with pytest.raises(ToolCallError, match="expected '\\? KEY'"):
            fmt.parse(bad)


def test_calc_evaluates_arithmetic_without_eval():
    assert calc("123*456") == 56088  # 123 * 456 = 56088
    assert calc("-(2+3)**2 // 4") == -7  # -(25) // 4 = -6.25 floored = -7
    assert calc("7 / 2") == 3.5
    with pytest.raises(ToolError, match="unsupported expression element Call"):
        calc("__import__('os').system('true')")
    with pytest.raises(ToolError, match="unsupported expression element Name"):
        calc("x + 1")
    with pytest.raises(ToolError, match="exponent 1000 is larger than 64"):
        calc("2**1000")
    with pytest.raises(ToolError, match="division by zero"):
        calc("1/0")
    with pytest.raises(ToolError, match="cannot parse"):
        calc("1 +")


def test_tool_env_counts_calls_errors_and_scores_the_final_answer():
    env = ToolEnv(tools=("calc",), scorer="exact_match")
    env.reset({"ground_truth": "56088", "extra_info": {}})
    first = env.step(hermes({"name": "calc", "arguments": {"expr": "123*456"}}))
    assert (first.observation, first.done, first.info["tool_calls"], first.info["tool_errors"]) == ("56088", False,
                                                                                                     1, 0)
    bad = env.step("<tool_call>{not json}</tool_call>")
    assert bad.observation.startswith("tool call error: the call is not valid JSON") and not bad.done
    assert (bad.info["tool_calls"], bad.info["tool_errors"], bad.info["malformed"]) == (1, 1, 1)
    unknown = env.step(hermes({"name": "python", "arguments": {"code": "1"}}))  # not among this env's tools
    assert unknown.info["error_reasons"] == ["invalid_call"] and "unknown tool 'python'" in unknown.observation
    final = env.step("56088")
    assert (final.done, final.reward, final.observation) == (True, 1.0, None)


def test_too_many_calls_in_one_turn_are_refused():
    env = ToolEnv(tools=("calc",), max_calls_per_turn=1)
    env.reset({"ground_truth": "1"})
    result = env.step(hermes({"name": "calc", "arguments": {"expr": "1"}}) * 2)
    assert result.info["tool_errors"] == 2 and "at most 1" in result.observation


def test_lookup_env_reads_the_episode_table_and_rewards_valid_calls():
    env = lookup_env(valid_call_reward=0.25)
    env.reset({"ground_truth": "7", "extra_info": {"lookup": {"q": "7", "b": "2"}}})
    missing = env.step("? z")
    assert (missing.observation, missing.reward, missing.info["error_reasons"]) == ("tool error: lookup: no key 'z'",
                                                                                     0.0, ["missing"])
    call = env.step("? q")
    assert (call.observation, call.reward, call.done) == ("7", 0.0, False)  # no bonus for a call alone
    assert env.step("7 b").reward == 1.25  # prefix_match 1.0 + the bonus for having called successfully
    guess = lookup_env(valid_call_reward=0.25)
    guess.reset({"ground_truth": "7", "extra_info": {"lookup": {"q": "7"}}})
    assert guess.step("? z").reward == 0.0 and guess.step("7").reward == 1.0  # a failed call earns no bonus


def test_retrieval_reward_needs_a_tool_result_holding_the_answer():
    table = {"q": "7", "b": "2"}
    right = lookup_env(retrieval_reward=0.5)
    right.reset({"ground_truth": "7", "extra_info": {"lookup": table}})
    right.step("? q")  # returns "7", the ground truth
    assert right.step("3").reward == 0.5  # wrong answer (0) + retrieval bonus
    wrong_key = lookup_env(retrieval_reward=0.5)
    wrong_key.reset({"ground_truth": "7", "extra_info": {"lookup": table}})
    wrong_key.step("? b")  # returns "2"
    assert wrong_key.step("7").reward == 1.0  # right answer (1) without the bonus


def test_lookup_without_key_looks_up_the_asked_key():
    env = lookup_env(valid_call_reward=0.25, with_key=False)
    assert env.stop_strings == ("?",)
    env.reset({"ground_truth": "7", "extra_info": {"lookup": {"q": "7", "b": "2"}, "key": "q"}})
    with pytest.raises(ToolCallError, match="expected '\\?', got '\\? q'"):
        env.format.parse("? q")
    assert env.step("?").observation == "7"
    assert env.step("7").reward == 1.25


@pytest.mark.parametrize(("code", "reason"), [
    ("while True:\n    pass", "cpu_time"),
    ("x = bytearray(512 * 2**20)", "memory"),
    ("import socket\nsocket.socket().connect(('1.1.1.1', 80))", "denied"),
    ("open('/etc/fleetrl-test', 'w')", "denied"),
    ("import os\nwhile True:\n    os.fork()", "process_limit"),
    ("1 / 0", "error"),
])
def test_each_sandbox_fault_is_a_tool_error_with_reason(code, reason):
    env = ToolEnv(tools=("python",), sandbox={"cpu_s": 1, "wall_s": 20, "memory_mb": 128, "max_procs": 8})
    env.reset({"ground_truth": "1"})
    call = json.dumps({"name": "python", "arguments": {"code": code}})
    result = env.step(f"<tool_call>{call}</tool_call>")
    assert not result.done and result.reward == 0.0
    assert result.info["tool_errors"] == 1 and result.info["error_reasons"] == [reason]
    assert result.observation.startswith(f"tool error: python: {reason}")
