"""`code` scorer: runs a code answer against test cases in the sandbox; the score is the fraction that pass.

The ground truth (a dict, or the same as a JSON string, as verl-style parquet files store it) is either
  {"asserts": ["assert f(2) == 4", ...]}                      the answer defines things; each assert is a case
  {"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}        the answer is a program; stdin -> expected stdout
The code is the last ```python (or bare ```) block of the response, else the whole response. Asserts share one
sandbox run (the definitions run once, each assert after them); stdin/stdout cases run one sandbox each.
Stdout is compared line by line with trailing whitespace ignored.
"""
from __future__ import annotations

import json
import re
import secrets
from typing import Any

from fleetrl.rewards.errors import RewardError
from fleetrl.sandbox import SandboxLimits, run_python

CODE_LIMITS = SandboxLimits(cpu_s=5, wall_s=15, memory_mb=512, max_procs=16, max_output_bytes=65536)
_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)
_FORMAT_HELP = ('expected {"asserts": [str, ...]} or {"inputs": [str, ...], "outputs": [str, ...]} (a dict or '
                "its JSON string)")

# Runs the answer, then each assert, with the answer's own prints swallowed; reports one marker line per case.
_HARNESS = """
import contextlib, io, sys
_real_out, _ns = sys.stdout, {"__name__": "solution"}
try:
    with contextlib.redirect_stdout(io.StringIO()):
        exec(%(solution)r, _ns)
except BaseException as _exc:
    sys.exit(1)
for _i, _case in enumerate(%(cases)r):
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            exec(_case, _ns)
        _real_out.write("%(nonce)s %%d pass\\n" %% _i)
    except BaseException:
        _real_out.write("%(nonce)s %%d fail\\n" %% _i)
    _real_out.flush()
"""


def extract_code(response: str) -> str:
    blocks = _BLOCK.findall(response)
    return blocks[-1] if blocks else response


def code_tests(response: str, ground_truth: Any, extra_info: dict, limits: SandboxLimits = CODE_LIMITS) -> float:
    """Fraction of the ground truth's test cases the response's code passes (0.0 with no code)."""
    tests = _parse_tests(ground_truth)
    code = extract_code(response)
    if not code.strip():
        return 0.0
    if "asserts" in tests:
        return _run_asserts(code, [str(a) for a in tests["asserts"]], limits)
    cases = list(zip(tests["inputs"], tests["outputs"]))
    passed = sum(_stdio_case(code, str(stdin), str(expected), limits) for stdin, expected in cases)
    return passed / len(cases)


def _parse_tests(ground_truth: Any) -> dict:
    tests = ground_truth
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError as exc:
            raise RewardError(f"code scorer: ground_truth is a string but not JSON ({exc.msg}); {_FORMAT_HELP}") \
                from None
    if isinstance(tests, dict) and isinstance(tests.get("asserts"), list) and tests["asserts"]:
        return tests
    if (isinstance(tests, dict) and isinstance(tests.get("inputs"), list) and isinstance(tests.get("outputs"), list)
            and tests["inputs"] and len(tests["inputs"]) == len(tests["outputs"])):
        return tests
    raise RewardError(f"code scorer: cannot read test cases from ground_truth {str(ground_truth)[:120]!r}; "
                      f"{_FORMAT_HELP}, with at least one case and as many outputs as inputs")


def _run_asserts(code: str, asserts: list[str], limits: SandboxLimits) -> float:
    nonce = "fleetrl-case-" + secrets.token_hex(8)  # the answer cannot print a forged marker it does not know
    result = run_python(_HARNESS % {"solution": code, "cases": asserts, "nonce": nonce}, limits)
    passed = {int(line.split()[1]) for line in result.stdout.splitlines()
              if line.startswith(nonce + " ") and line.endswith(" pass")}
    return len(passed & set(range(len(asserts)))) / len(asserts)


def _stdio_case(code: str, stdin: str, expected: str, limits: SandboxLimits) -> bool:
    result = run_python(code, limits, stdin=stdin)
    return result.ok and _lines(result.stdout) == _lines(expected)


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.strip().splitlines()]
