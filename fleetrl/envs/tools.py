"""Tool calls: call formats (how a call is written), strict validation, the tool registry and built-in tools.

A call format turns a model turn into zero or more `ToolCall`s or raises `ToolCallError` for a malformed one:
  hermes   `<tool_call>{"name": "calc", "arguments": {"expr": "2*3"}}</tool_call>` (Hermes / Qwen2.5 / Qwen3 chat
           models). Strict: the JSON must parse, be an object with exactly "name" and "arguments".
  words    `? k` — a trigger word, then one word per argument. For word-level test tokenizers that cannot spell
           JSON (the tiny tokenizer has no `{`, `"` or `<tool_call>`), see `WordsFormat`.
Both produce the same ToolCall, which `validate_call` then checks the same way: the tool exists, the argument
names are exactly the tool's parameters and each value has the declared JSON type.
"""
from __future__ import annotations

import ast
import json
import operator
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from fleetrl.sandbox import SandboxLimits, run_python


class ToolCallError(ValueError):
    """A malformed or invalid call; its message is shown to the model as the observation."""


class ToolError(RuntimeError):
    """A tool ran and failed (bad expression, sandbox limit hit); `reason` is a short machine-readable cause."""

    def __init__(self, message: str, reason: str = "error") -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class Tool:
    """`parameters`: every argument (all required) -> its JSON type (str, int, float, bool).
    `run(arguments, sample)` returns the result text or raises ToolError."""

    name: str
    description: str
    parameters: dict[str, type]
    run: Callable[[dict[str, Any], dict], str]


class CallFormat(Protocol):
    stop_strings: tuple[str, ...]  # strings that end a model turn after a call (passed to the engine)

    def parse(self, text: str) -> list[ToolCall]:
        """The calls in a model turn; [] when the turn is a final answer; ToolCallError when malformed."""
        ...


class HermesFormat:
    stop_strings = ("</tool_call>",)
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str) -> list[ToolCall]:
        bodies = self._BLOCK.findall(text)
        if text.count("<tool_call>") != len(bodies) or text.count("</tool_call>") != len(bodies):
            raise ToolCallError("tool call error: unbalanced <tool_call> ... </tool_call> tags")
        return [self._one(body) for body in bodies]

    @staticmethod
    def _one(body: str) -> ToolCall:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as exc:
            raise ToolCallError(f"tool call error: the call is not valid JSON ({exc.msg} at char {exc.pos})") from None
        if not isinstance(obj, dict) or set(obj) != {"name", "arguments"}:
            raise ToolCallError('tool call error: expected {"name": ..., "arguments": {...}} and nothing else')
        if not isinstance(obj["name"], str) or not isinstance(obj["arguments"], dict):
            raise ToolCallError("tool call error: name must be a string and arguments an object")
        return ToolCall(obj["name"], obj["arguments"])


class WordsFormat:
    """`TRIGGER ARG1 ARG2 ...` as the whole turn calls `tool` with `arg_names` bound in order; a turn without the
    trigger word is a final answer. Strict: the trigger must come first and only once, with exactly one word
    per argument. Values are strings (words). A turn ends at EOS, or at one of `stop_strings`: listing every
    complete call (e.g. "? a" ... "? z") ends the turn right after the call, so the model need not learn to
    emit EOS after it (a longer word starting the same way, "? add", also stops there and then fails
    validation)."""

    def __init__(self, trigger: str, tool: str, arg_names: tuple[str, ...], stop_strings: tuple[str, ...] = ()) -> None:
        self.trigger, self.tool, self.arg_names = trigger, tool, tuple(arg_names)
        self.stop_strings = tuple(stop_strings)

    def parse(self, text: str) -> list[ToolCall]:
        words = text.split()
        if self.trigger not in words:
            return []
        shape = " ".join([self.trigger, *(a.upper() for a in self.arg_names)])
        if words[0] != self.trigger or words.count(self.trigger) != 1 or len(words) != 1 + len(self.arg_names):
            raise ToolCallError(f"tool call error: expected '{shape}', got {text.strip()!r}")
        return [ToolCall(self.tool, dict(zip(self.arg_names, words[1:])))]


CALL_FORMATS: dict[str, Callable[[], CallFormat]] = {"hermes": HermesFormat}


def validate_call(call: ToolCall, tools: dict[str, Tool]) -> Tool:
    """The tool a call names, after checking its arguments against the tool's parameters (ToolCallError if not)."""
    tool = tools.get(call.name)
    if tool is None:
        raise ToolCallError(f"tool call error: unknown tool {call.name!r}; available: {sorted(tools)}")
    given, wanted = set(call.arguments), set(tool.parameters)
    if given != wanted:
        raise ToolCallError(f"tool call error: {call.name} takes arguments {sorted(wanted)}, got {sorted(given)}")
    for key, kind in tool.parameters.items():
        value = call.arguments[key]
        # bool is an int subclass in Python but not a number in JSON; int is accepted where float is declared.
        ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
        ok = ok or (kind is float and isinstance(value, int) and not isinstance(value, bool))
        if not ok:
            raise ToolCallError(f"tool call error: {call.name}.{key} must be a {kind.__name__}, "
                                f"got {type(value).__name__}")
    return tool


# ------------------------------------------------------------------------------------------ built-in tools
TOOLS: dict[str, Tool] = {}


def register_tool(tool: Tool) -> Tool:
    if tool.name in TOOLS and TOOLS[tool.name] is not tool:
        raise ValueError(f"tool {tool.name!r} is already registered")
    TOOLS[tool.name] = tool
    return tool


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_EXPONENT = 64
_MAX_DIGITS = 200


def calc(expr: str) -> int | float:
    """Evaluates + - * / // % ** and parentheses over int/float literals by walking the AST (no eval).
    Exponents are capped at 64 and results at 200 digits so that a call cannot burn CPU or memory."""
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        raise ToolError(f"calc: cannot parse {expr!r}", "syntax") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise ToolError(f"calc: exponent {right} is larger than {_MAX_EXPONENT}", "limit")
        try:
            value = _BINARY[type(node.op)](left, right)
        except (ZeroDivisionError, OverflowError) as exc:
            raise ToolError(f"calc: {exc}", "math") from None
        if isinstance(value, int) and abs(value) >= 10**_MAX_DIGITS:
            raise ToolError(f"calc: result has more than {_MAX_DIGITS} digits", "limit")
        return value
    raise ToolError(f"calc: unsupported expression element {type(node).__name__}; only numbers, + - * / // % ** "
                    "and parentheses", "syntax")


register_tool(Tool("calc", "Evaluates an arithmetic expression, e.g. 123*456.", {"expr": str},
                   lambda args, sample: str(calc(args["expr"]))))

# Sandboxes are whole Python processes; on a small machine more than a few at once only queue on the CPUs.
_SANDBOX_SLOTS = threading.BoundedSemaphore(4)
PYTHON_LIMITS = SandboxLimits(cpu_s=5, wall_s=10, memory_mb=512, max_procs=16, max_output_bytes=4096)


def make_python_tool(limits: SandboxLimits = PYTHON_LIMITS) -> Tool:
    """The `python` tool with the given sandbox limits: runs `code`, returns its stdout; a run that fails (an
    exception, a limit, a refused operation) raises ToolError whose reason is the sandbox's REASON_*."""

    def run(args: dict[str, Any], sample: dict) -> str:
        with _SANDBOX_SLOTS:
            result = run_python(args["code"], limits)
        if not result.ok:
            tail = "\n".join(result.stderr.strip().splitlines()[-3:])
            raise ToolError(f"python: {result.reason}" + (f": {tail}" if tail else ""), result.reason or "error")
        return result.stdout + ("\n[output truncated]" if result.truncated else "")

    return Tool("python", "Runs a Python script in a sandbox and returns its stdout.", {"code": str}, run)


register_tool(make_python_tool())


def lookup(args: dict[str, Any], sample: dict) -> str:
    """Reads the episode's table, `sample["extra_info"]["lookup"]` (key -> value), as the synthetic lookup task
    writes it; the answer exists only there, so the task cannot be solved without calling the tool."""
    table = (sample.get("extra_info") or {}).get("lookup") or {}
    if args["key"] not in table:
        raise ToolError(f"lookup: no key {args['key']!r}", "missing")
    return str(table[args["key"]])


register_tool(Tool("lookup", "Returns the value stored under a key.", {"key": str}, lookup))


def lookup_asked(args: dict[str, Any], sample: dict) -> str:
    """The value of the key the prompt asks about (`extra_info["key"]`): `lookup` without the argument, for a
    policy that has to learn to call and to read the result but not to copy the key into the call."""
    info = sample.get("extra_info") or {}
    if "key" not in info:
        raise ToolError("lookup_asked: the sample has no extra_info.key", "missing")
    return lookup({"key": info["key"]}, sample)


register_tool(Tool("lookup_asked", "Returns the value of the key the question asks about.", {}, lookup_asked))
