"""Built-in scorers on hand-picked responses."""
from __future__ import annotations

import threading

import pytest

from fleetrl.rewards import RewardError, make_format_scorer
from fleetrl.rewards.scorers import (
    exact_match,
    format_match,
    gsm8k,
    last_boxed,
    math_answer,
    prefix_match,
)


@pytest.mark.parametrize("response, truth, expected", [
    (" Paris \n", "Paris", 1.0),
    ("paris", "Paris", 0.0),
    ("42", 42, 1.0),
    ("B", ["A", "B"], 1.0),
    ("C", ["A", "B"], 0.0),
])
def test_exact_match(response, truth, expected):
    assert exact_match(response, truth, {}) == expected


@pytest.mark.parametrize("response, truth, expected", [
    ("42", "42", 1.0),
    ("42. Because 6 * 7", "42", 1.0),
    ("42 is the answer", "42", 1.0),
    ("421", "42", 0.0),
    ("The answer is 42", "42", 0.0),
    ("yes, obviously", ["no", "yes"], 1.0),
    ("anything", "", 0.0),
])
def test_prefix_match(response, truth, expected):
    assert prefix_match(response, truth, {}) == expected


@pytest.mark.parametrize("response, truth, expected", [
    ("so the total is\n#### 1,234", "1234", 1.0),
    ("#### $1,234.", "1234", 1.0),
    ("She has 3 apples, then 5, so 8 in all.", "8", 1.0),
    ("8 apples, wait, no: 9", "8", 0.0),  # the last number counts
    ("3.0", "3", 1.0),
    ("#### 72 (and 5 spare)", "72", 1.0),  # after ####, the first number
    ("-$5", "-5", 1.0),
    ("no digits here", "0", 0.0),
    ("#### 18", "Natalia sold 48/2 = 24 clips.\n#### 18", 1.0),  # full-solution ground truth
    ("The answer is 2,3", "23", 0.0),  # not a thousands separator: reads 2 and 3, the last number is 3
    ("The answer is 2,3", "3", 1.0),
    ("#### 1,2345", "12345", 0.0),  # a 4-digit group is no thousands group: "1" is the number after ####
    ("#### 12,345,678", "12345678", 1.0),
])
def test_gsm8k(response, truth, expected):
    assert gsm8k(response, truth, {}) == expected


def test_last_boxed_balances_nested_braces():
    assert last_boxed(r"first \boxed{1} then \boxed{\frac{\sqrt{2}}{2}} done") == r"\frac{\sqrt{2}}{2}"
    assert last_boxed(r"cut off \boxed{\frac{1}{2") is None
    assert last_boxed("no box") is None


@pytest.mark.parametrize("response, truth, expected", [
    (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"\boxed{1/2}", r"\dfrac{1}{2}", 1.0),
    (r"\boxed{\tfrac12}", "1/2", 1.0),
    (r"\boxed{-\frac{3}{4}}", "-0.75", 1.0),
    (r"\boxed{3.0}", "3", 1.0),
    (r"\boxed{\frac{1}{3}}", "0.333", 0.0),  # exact comparison: a rounded decimal is not the fraction
    (r"\boxed{\left( 1, 2 \right)}", "(1,2)", 1.0),
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{\sqrt2}{2}", 1.0),  # symbolic (math-verify): \sqrt2 == \sqrt{2}
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{ \sqrt{2} }{2}", 1.0),
    (r"\boxed{x = 5}", "5", 1.0),
    (r"\boxed{90^\circ}", "90", 1.0),
    (r"\boxed{\text{(B)}}", "(B)", 1.0),
    (r"so \boxed{4}, then \boxed{5}", "5", 1.0),
    ("5", "5", 0.0),  # no box, no credit
    (r"\boxed{5}", r"The answer is $\boxed{5}$.", 1.0),
])
def test_math(response, truth, expected):
    assert math_answer(response, truth, {}) == expected


# Issue 13: the old normaliser read comma lists as thousands and missed \$, units, \sqrt3 and brace-less \boxed.
ISSUE_13_MATH = [
    (r"\boxed{2, 3}", "23", 0.0),  # a list of two numbers is not 23
    (r"\boxed{-1, 2}", "-12", 0.0),
    (r"\boxed{12}", "1, 2", 0.0),
    (r"\boxed{\$5}", "5", 1.0),
    (r"\boxed{5\text{ cm}}", "5", 1.0),
    (r"\boxed{\sqrt3}", r"\sqrt{3}", 1.0),
    (r"\boxed 5", "5", 1.0),
    (r"\boxed{1,234}", "1234", 1.0),  # a real thousands separator still reads as one number
    (r"\boxed{3, 2}", r"\{2, 3\}", 1.0),  # lists compare as sets
]


@pytest.mark.parametrize("response, truth, expected", ISSUE_13_MATH)
def test_math_issue_13_cases(response, truth, expected):
    assert math_answer(response, truth, {}) == expected


@pytest.mark.parametrize("response, truth, expected", [
    (r"\boxed{\, ???}", "???", 1.0),  # math-verify returns the raw string for both: normaliser drops "\,"
    (r"\boxed{???}", r"\mathrm{???}", 1.0),  # normaliser unwraps \mathrm
    (r"\boxed{??}", "???", 0.0),
])
def test_math_falls_back_to_normaliser_where_math_verify_cannot_parse(response, truth, expected):
    assert math_answer(response, truth, {}) == expected


def test_math_off_the_main_thread():
    # Reward runner workers are threads; math-verify's signal-based timeout cannot run there, and with it on
    # every comparison would silently fail (score 0). Each case must score as on the main thread.
    cases = ISSUE_13_MATH + [(r"\boxed{\frac{1}{2}}", "0.5", 1.0)]
    results: list[float] = []
    worker = threading.Thread(target=lambda: results.extend(math_answer(r, t, {}) for r, t, _ in cases))
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive(), "math_answer did not finish within 60 s on a worker thread"
    assert results == [expected for _, _, expected in cases]


def test_last_boxed_braceless():
    assert last_boxed(r"so \boxed 5 done") == "5"
    assert last_boxed(r"$\boxed 42$") == "42"
    assert last_boxed(r"\boxed{1} then \fbox{2}") == "2"
    assert last_boxed(r"\boxedfoo{1}") is None  # a different command, not \boxed


@pytest.mark.parametrize("response, expected", [
    ("<think>6 * 7</think> 42", 1.0),
    ("\n<think>\nlong\nreasoning\n</think>\n\nThe answer is 42", 1.0),
    ("<think></think> 42", 0.0),  # empty reasoning
    ("<think>6 * 7</think>", 0.0),  # no answer
    ("42", 0.0),
])
def test_default_format(response, expected):
    assert format_match(response, None, {}) == expected


def test_format_pattern_from_factory_and_extra_info():
    answer_tag = make_format_scorer(r".*<answer>.+</answer>\s*")
    assert answer_tag("reasoning <answer>4</answer>", None, {}) == 1.0
    assert answer_tag("<think>x</think> 4", None, {}) == 0.0
    assert format_match("ANSWER: 4", None, {"format_regex": r"ANSWER: \d+"}) == 1.0
    with pytest.raises(RewardError, match="not a valid regular expression"):
        make_format_scorer("(unclosed")
