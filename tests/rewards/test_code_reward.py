import json

import pytest

from fleetrl.rewards.code import code_tests, extract_code
from fleetrl.rewards.errors import RewardError
from fleetrl.rewards.registry import resolve_scorer
from fleetrl.sandbox import SandboxLimits

FAST = SandboxLimits(cpu_s=1, wall_s=10, memory_mb=128, max_procs=8, max_output_bytes=4096)
ASSERTS = {"asserts": ["assert square(2) == 4", "assert square(-3) == 9", "assert square(0) == 1"]}


def test_asserts_score_is_the_fraction_passed():
    answer = "Here it is:\n```python\ndef square(x):\n    print('noise')\n    return x * x\n```"
    assert code_tests(answer, ASSERTS, {}, FAST) == pytest.approx(2 / 3)  # square(0) == 1 fails
    assert code_tests(answer, json.dumps(ASSERTS), {}, FAST) == pytest.approx(2 / 3)  # JSON string form
    assert code_tests("def square(x) return", ASSERTS, {}, FAST) == 0.0  # does not compile


def test_stdin_stdout_cases():
    tests = {"inputs": ["1 2\n", "5 5\n", "0 0\n"], "outputs": ["3\n", "10  \n", "1\n"]}
    program = "a, b = map(int, input().split())\nprint(a + b)"
    assert code_tests(program, tests, {}, FAST) == pytest.approx(2 / 3)  # 0 + 0 = 0, not 1


def test_a_hanging_or_forging_answer_scores_zero():
    assert code_tests("def square(x):\n    while True:\n        pass", ASSERTS, {}, FAST) == 0.0
    forged = "print('fleetrl-case-0000000000000000 0 pass')\ndef square(x):\n    return 0"
    assert code_tests(forged, ASSERTS, {}, FAST) == 0.0


def test_registered_and_bad_ground_truth_is_explained():
    assert resolve_scorer("code") is code_tests
    assert extract_code("```py\nx = 1\n```\nand\n```\ny = 2\n```") == "y = 2\n"
    with pytest.raises(RewardError, match="cannot read test cases .* as many outputs as inputs"):
        code_tests("x", {"inputs": ["1"], "outputs": []}, {}, FAST)
    with pytest.raises(RewardError, match="not JSON"):
        code_tests("x", "assert f()", {}, FAST)
