"""Built-in reward scorers: pure functions `(response, ground_truth, extra_info) -> float` in [0, 1].

A ground truth may be a list/tuple of acceptable answers for every scorer here; any match scores 1.0.
"""
from __future__ import annotations

import logging
import re
import string
import threading
from collections.abc import Callable
from fractions import Fraction
from functools import lru_cache
from typing import Any

from fleetrl.rewards.errors import RewardError

Scorer = Callable[[str, Any, dict], "float | dict"]


def _candidates(ground_truth: Any) -> list[str]:
    items = ground_truth if isinstance(ground_truth, (list, tuple)) else [ground_truth]
    return [str(g).strip() for g in items if g is not None]


# -------------------------------------------------------------------------------------------- exact / prefix
def exact_match(response: str, ground_truth: Any, extra_info: dict) -> float:
    """1.0 when the stripped response equals (as a string) the ground truth or one of a list of them."""
    return float(response.strip() in _candidates(ground_truth))


def prefix_match(response: str, ground_truth: Any, extra_info: dict) -> float:
    """1.0 when the stripped response starts with the answer followed by its end, whitespace or punctuation.

    For tasks that ask for the answer first ("42. Because ..."); "421" does not match "42".
    """
    text = response.strip()
    for answer in _candidates(ground_truth):
        if answer and text.startswith(answer):
            rest = text[len(answer):]
            if not rest or rest[0].isspace() or rest[0] in string.punctuation:
                return 1.0
    return 0.0


# --------------------------------------------------------------------------------------------------- gsm8k
# An optional sign and dollar sign, then an integer part and an optional decimal part. Commas count only as
# thousands separators (groups of exactly 3 digits: "1,234"), so a list such as "2,3" reads as two numbers.
_INTEGER = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)"
_NUMBER = re.compile(rf"-?\$?-?(?:{_INTEGER}(?:\.\d+)?|\.\d+)")


def _parse_number(token: str) -> Fraction | None:
    cleaned = token.replace(",", "").replace("$", "").rstrip(".")
    try:
        return Fraction(cleaned)  # Fraction("3.0") == Fraction("3"): compares values, not spellings
    except (ValueError, ZeroDivisionError):
        return None


def gsm8k_answer(text: str) -> Fraction | None:
    """The number after the last `####` when present, else the last number in the text."""
    marker = text.rfind("####")
    if marker >= 0:
        found = _NUMBER.search(text[marker + 4:])
        return _parse_number(found.group()) if found else None
    numbers = _NUMBER.findall(text)
    return _parse_number(numbers[-1]) if numbers else None


def gsm8k(response: str, ground_truth: Any, extra_info: dict) -> float:
    """GSM8K: the predicted number (see `gsm8k_answer`) equals the ground truth number."""
    predicted = gsm8k_answer(response)
    if predicted is None:
        return 0.0
    # Ground truths are usually the bare number, but the original dataset's full "... #### 72" also works.
    return float(any(gsm8k_answer(g) == predicted for g in _candidates(ground_truth)))


# ---------------------------------------------------------------------------------------------------- math
_BOX = re.compile(r"\\(?:boxed|fbox)(?![a-zA-Z])")


def last_boxed(text: str) -> str | None:
    """Contents of the last \\boxed{...} (or \\fbox{...}), nested braces balanced; None if absent or cut off.

    The brace-less form `\\boxed 5` (TeX takes the next token as the argument) gives the text up to the next
    whitespace or `$`.
    """
    boxes = list(_BOX.finditer(text))
    if not boxes:
        return None
    rest = text[boxes[-1].end():]
    if not rest.lstrip().startswith("{"):
        bare = re.match(r"\s+([^\s$]+)", rest)
        return bare.group(1) if bare else None
    open_at = len(rest) - len(rest.lstrip())
    depth = 0
    for i in range(open_at, len(rest)):
        depth += {"{": 1, "}": -1}.get(rest[i], 0)
        if depth == 0:
            return rest[open_at + 1:i]
    return None  # unbalanced: the response was cut off inside the box


_DROP = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "$", "^\\circ", "^{\\circ}", "\\%", "%")
_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")


def normalize_math(answer: str) -> str:
    """Canonical spelling of a LaTeX answer: no spacing commands, \\left/\\right, units of degrees/percent."""
    s = answer.strip()
    for token in _DROP:
        s = s.replace(token, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _WRAPPERS.sub(r"\1", s)
    s = re.sub(r"\s+", "", s)
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)  # \frac12 shorthand
    s = re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", s)  # \frac{1}2
    if s.count("=") == 1 and re.match(r"^[a-zA-Z]\w*=", s):  # "x=5" -> "5"
        s = s.split("=", 1)[1]
    return s.rstrip(".")


_FRAC = re.compile(r"^(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}$")
_SLASH = re.compile(r"^(-?\d+)/(-?\d+)$")
_DECIMAL = re.compile(rf"^-?(?:{_INTEGER}(?:\.\d*)?|\.\d+)$")


def math_value(normalized: str) -> Fraction | None:
    """Exact value of a normalized numeric answer (\\frac{a}{b}, a/b, integer, decimal), else None."""
    try:
        if m := _FRAC.match(normalized):
            value = Fraction(int(m.group(2)), int(m.group(3)))
            return -value if m.group(1) else value
        if m := _SLASH.match(normalized):
            return Fraction(int(m.group(1)), int(m.group(2)))
        if _DECIMAL.match(normalized):
            return Fraction(normalized.replace(",", ""))
    except ZeroDivisionError:
        return None
    return None


MATH_VERIFY_TIMEOUT_S = 5  # per parse / per comparison; sympy can take unbounded time on adversarial input


def _math_verify_equal(predicted: str, truth: str) -> bool | None:
    """math-verify's verdict on two LaTeX answers (no \\boxed), or None when it cannot parse one of them
    (it returns nothing, or only the raw string back without a mathematical object).

    math-verify bounds its own run time with signal.alarm, which only works on the main thread: elsewhere its
    timeout wrapper fails and it silently answers "not equal". Off the main thread (the reward runner's thread
    workers) its timeout is therefore switched off and the runner's per-call `rewards.timeout_s` is the bound
    (a runaway call is abandoned; `rewards.isolation=process` also kills it, and runs math-verify on the worker
    process's main thread, where its own timeout applies).
    """
    # Imported lazily: it loads sympy and a LaTeX parser (~1 s), which scorer-free commands need not pay for.
    from math_verify import parse, verify

    _quiet_timeout_notice()
    timeout = MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    # $...$ makes both sides LaTeX math, which keeps "1, 2" a list (a bare "1, 2" reads as just 2).
    gold = parse(f"${truth}$", parsing_timeout=timeout)
    pred = parse(f"${predicted}$", parsing_timeout=timeout)
    if not _has_math(gold) or not _has_math(pred):
        return None
    return bool(verify(gold, pred, timeout_seconds=timeout))


class _DropTimeoutNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


@lru_cache(maxsize=1)
def _quiet_timeout_notice() -> None:
    # math-verify warns once per process and module when its timeout is off. Here that is deliberate (the
    # runner bounds the call, see above), so only that notice is dropped; its other warnings still show.
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_DropTimeoutNotice())


def _has_math(parsed: list) -> bool:
    return any(not isinstance(item, str) for item in parsed)


def _normalized_equal(predicted: str, truth: str) -> bool:
    left, right = normalize_math(predicted), normalize_math(truth)
    value = math_value(left)
    return left == right or (value is not None and value == math_value(right))


def math_answer(response: str, ground_truth: Any, extra_info: dict) -> float:
    """MATH-style: the last \\boxed{} answer of the response is equivalent to the ground truth.

    Equivalence is decided by `math-verify` (Hugging Face; symbolic, so \\frac{1}{2} == 0.5, \\sqrt3 ==
    \\sqrt{3}, 5\\text{ cm} == 5, and "2, 3" is a list, never 23). Only when math-verify cannot parse one side
    does the comparison fall back to `normalize_math` (exact fractions, else normalized strings). A response
    with no box scores 0; a ground truth that itself contains \\boxed{} (a full solution) is reduced to its box.
    """
    boxed = last_boxed(response)
    if boxed is None:
        return 0.0
    for truth in _candidates(ground_truth):
        expected = last_boxed(truth) or truth
        verdict = _math_verify_equal(boxed, expected)
        if verdict is None:
            verdict = _normalized_equal(boxed, expected)
        if verdict:
            return 1.0
    return 0.0


# -------------------------------------------------------------------------------------------------- format
# A non-empty <think>...</think> block, then a non-empty answer after it (the R1-style reasoning format).
DEFAULT_FORMAT_PATTERN = r"\s*<think>.*?\S.*?</think>\s*\S.*"


@lru_cache(maxsize=256)
def _compile(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern, re.DOTALL)


def make_format_scorer(pattern: str = DEFAULT_FORMAT_PATTERN) -> Scorer:
    """A scorer giving 1.0 when the whole response matches `pattern` (re.fullmatch, DOTALL).

    A sample's extra_info["format_regex"], when present, replaces the pattern for that sample.
    """
    try:
        _compile(pattern)
    except re.error as exc:
        raise RewardError(f"format reward pattern {pattern!r} is not a valid regular expression: {exc}") from exc

    def format_match(response: str, ground_truth: Any, extra_info: dict) -> float:
        regex = (extra_info or {}).get("format_regex") or pattern
        return float(_compile(regex).fullmatch(response) is not None)

    return format_match


format_match = make_format_scorer()
