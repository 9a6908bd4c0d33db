"""ToolEnv: a model turn with tool calls gets the tools' results back; a turn without one is the final answer.

Every fault of a call becomes text the model reads and a counter the rollout sums (StepResult.info): a malformed
or invalid call (ToolCallError), a tool that fails (ToolError, e.g. a sandbox limit) and a tool that raises
anything else all count as tool errors, and the episode goes on.
"""
from __future__ import annotations

import string
import time
from collections.abc import Sequence

from fleetrl.envs.base import (
    INFO_TOOL_CALLS,
    INFO_TOOL_ERRORS,
    INFO_TOOL_TIME,
    EnvError,
    StepResult,
    register_env,
    score_answer,
)
from fleetrl.envs.tools import (
    CALL_FORMATS,
    TOOLS,
    CallFormat,
    ToolCallError,
    ToolError,
    WordsFormat,
    make_python_tool,
    validate_call,
)
from fleetrl.rewards.registry import resolve_scorer
from fleetrl.sandbox import SandboxLimits


@register_env("tools")
class ToolEnv:
    """`tools`: registered tool names (fleetrl.envs.tools.TOOLS); `call_format`: a CALL_FORMATS name or a
    CallFormat; `scorer`: how the final answer is scored (a scorer spec, see fleetrl.rewards.registry);
    `max_calls_per_turn`: calls past this in one turn are refused with an error observation;
    `valid_call_reward`: added to the final answer's score when the episode made a successful call before it
    (0 = off), a shaping term that helps a policy discover "call, then answer" before it gets answers right;
    `retrieval_reward`: likewise, when some successful tool result contained the ground truth as a word (the
    tool handed the model its answer), which rewards calling the tool with the right arguments;
    `sandbox`: SandboxLimits fields for the `python` tool (e.g. {"cpu_s": 2, "memory_mb": 256}), default
    fleetrl.envs.tools.PYTHON_LIMITS."""

    def __init__(self, tools: Sequence[str] = ("python", "calc"), call_format: str | CallFormat = "hermes",
                 scorer: str = "exact_match", max_calls_per_turn: int = 4, valid_call_reward: float = 0.0,
                 retrieval_reward: float = 0.0, sandbox: dict | None = None) -> None:
        unknown = sorted(set(tools) - set(TOOLS))
        if unknown:
            raise EnvError(f"ToolEnv: unknown tools {unknown}; registered tools are {sorted(TOOLS)}")
        if isinstance(call_format, str):
            if call_format not in CALL_FORMATS:
                raise EnvError(f"ToolEnv: unknown call_format {call_format!r}; choose from {sorted(CALL_FORMATS)} "
                               "or pass a CallFormat object")
            call_format = CALL_FORMATS[call_format]()
        self.tools = {name: TOOLS[name] for name in tools}
        if sandbox is not None and "python" in self.tools:
            self.tools["python"] = make_python_tool(SandboxLimits(**sandbox))
        self.format = call_format
        self.scorer = resolve_scorer(scorer)
        self.max_calls_per_turn = max_calls_per_turn
        self.valid_call_reward, self.retrieval_reward = valid_call_reward, retrieval_reward
        self.sample: dict | None = None
        self._called_ok = self._retrieved = False

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return tuple(self.format.stop_strings)

    def reset(self, sample: dict) -> None:
        self.sample = sample
        self._called_ok = self._retrieved = False

    def step(self, action: str) -> StepResult:
        assert self.sample is not None, "step before reset"
        try:
            calls = self.format.parse(action)
        except ToolCallError as exc:
            return StepResult(str(exc), 0.0, False, {INFO_TOOL_CALLS: 1, INFO_TOOL_ERRORS: 1, "malformed": 1})
        if not calls:
            # The shaping bonus is paid with the answer, never for a call alone: paid per call (tried first),
            # calling again instead of answering became the policy's best move.
            bonus = self.valid_call_reward * self._called_ok + self.retrieval_reward * self._retrieved
            return StepResult(None, score_answer(self.scorer, action, self.sample) + bonus, True, {})
        if len(calls) > self.max_calls_per_turn:
            return StepResult(f"tool call error: {len(calls)} calls in one turn; at most {self.max_calls_per_turn}",
                              0.0, False, {INFO_TOOL_CALLS: len(calls), INFO_TOOL_ERRORS: len(calls)})
        texts, errors, reasons, start = [], 0, [], time.monotonic()
        for call in calls:
            text, reason = self._run(call)
            texts.append(text)
            if reason is not None:
                errors, reasons = errors + 1, reasons + [reason]
            else:
                self._retrieved = self._retrieved or str(self.sample.get("ground_truth")).strip() in text.split()
        info = {INFO_TOOL_CALLS: len(calls), INFO_TOOL_ERRORS: errors, INFO_TOOL_TIME: time.monotonic() - start,
                "error_reasons": reasons}
        self._called_ok = self._called_ok or not errors
        return StepResult("\n".join(texts), 0.0, False, info)

    def _run(self, call) -> tuple[str, str | None]:
        """(observation text, error reason or None)."""
        try:
            tool = validate_call(call, self.tools)
        except ToolCallError as exc:
            return str(exc), "invalid_call"
        try:
            return tool.run(call.arguments, self.sample), None
        except ToolError as exc:
            return f"tool error: {exc}", exc.reason
        except Exception as exc:  # noqa: BLE001 — a tool is user code too; its crash is the model's observation, not ours
            return f"tool error: {call.name} raised {type(exc).__name__}: {exc}", "exception"


@register_env("lookup")
def lookup_env(valid_call_reward: float = 0.0, retrieval_reward: float = 0.0, with_key: bool = True) -> ToolEnv:
    """The synthetic lookup task's environment (synthetic:lookup).

    with_key=True: `? KEY` calls the episode's table with that key. with_key=False: a bare `?` calls
    `lookup_asked`, which looks up the key the prompt asks about (easier: nothing to copy into the call).
    The tiny word-level tokenizer cannot spell Hermes JSON, so the call is written in the `words` format; it
    still goes through the same validation as a Hermes call. The complete calls ("? a" ... "? z", or "?") are
    the stop strings: a turn ends as soon as a call is complete. The answer is scored with prefix_match (the
    digit first, then anything after a space), as the tiny model rarely stops right after it."""
    if with_key:
        calls = WordsFormat("?", "lookup", ("key",), stop_strings=tuple(f"? {c}" for c in string.ascii_lowercase))
    else:
        calls = WordsFormat("?", "lookup_asked", (), stop_strings=("?",))
    return ToolEnv(tools=(calls.tool,), call_format=calls, scorer="prefix_match",
                   valid_call_reward=valid_call_reward, retrieval_reward=retrieval_reward)
