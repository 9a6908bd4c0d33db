"""The environment protocol, the environment registry, and deadline-bounded calls into environments.

An environment plays one episode: `reset(sample)` once, then `step(action_text)` after every model turn until a
step says `done`. One instance serves one episode (the factory is called per sample), so episode state needs no
locking and cannot leak between samples. Environment code is user code: every call goes through `EnvCaller`,
which runs it on a daemon thread with a deadline and turns an exception or a timeout into an `Outcome` the
rollout counts, never into a crash or a hang.
"""
from __future__ import annotations

import inspect
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from types import ModuleType
from typing import Any, Protocol, runtime_checkable

from fleetrl.rewards.registry import resolve_scorer
from fleetrl.userfile import UserFileImportError, load_user_file

# Keys of StepResult.info the multi-turn rollout sums into its per-episode metrics.
INFO_TOOL_CALLS = "tool_calls"
INFO_TOOL_ERRORS = "tool_errors"
INFO_TOOL_TIME = "tool_time_s"


class EnvError(ValueError):
    """A configuration error about environments (unknown name, bad file spec); raised before training."""


@dataclass(frozen=True)
class StepResult:
    """What the environment answers to one model turn.

    observation: text to show the model as the next tool message (None when `done`).
    reward: added to the episode's return (the rollout's final reward is the sum over steps).
    info: counters the rollout sums per episode (INFO_* keys) plus anything else for debugging.
    """

    observation: str | None
    reward: float
    done: bool
    info: dict = field(default_factory=dict)


@runtime_checkable
class Env(Protocol):
    def reset(self, sample: dict) -> str | None:
        """Starts the episode for `sample` (data_source, ground_truth, extra_info, raw_prompt, ...).

        Returns the initial observation. The rollout's prompts are rendered by the data layer before the
        environment exists, so environments used with `run_multiturn` return None (the prompt is the first
        observation)."""
        ...

    def step(self, action: str) -> StepResult:
        """`action` is the decoded text of the model's turn (special tokens skipped)."""
        ...


EnvFactory = Callable[[dict], Env]  # sample -> a fresh environment for its episode

ENVS: dict[str, Callable[..., Env]] = {}


def register_env(name: str) -> Callable[[Callable[..., Env]], Callable[..., Env]]:
    """Decorator: `@register_env("lookup")` makes `rollout.env: lookup` build that class/factory."""

    def add(factory: Callable[..., Env]) -> Callable[..., Env]:
        if name in ENVS and ENVS[name] is not factory:
            raise EnvError(f"environment {name!r} is already registered by {ENVS[name]!r}")
        ENVS[name] = factory
        return factory

    return add


def env_factory(spec: str, **kwargs: Any) -> EnvFactory:
    """A factory making one fresh environment per episode (it receives the sample, which it may ignore) from a
    registered name or 'path/to/file.py:Class' (any callable returning an Env); `kwargs` go to every call.

    The first instance is built here, so a bad spec or bad kwargs fail at configuration time."""
    make = _resolve(spec)
    try:
        probe = make(**kwargs)
    except TypeError as exc:
        raise EnvError(f"environment {spec!r}: cannot construct it with {kwargs}: {exc}; its parameters are "
                       f"{_signature(make)}") from exc
    if not (callable(getattr(probe, "reset", None)) and callable(getattr(probe, "step", None))):
        raise EnvError(f"environment {spec!r} built a {type(probe).__name__}, which lacks reset(sample) and "
                       "step(action) methods (see fleetrl.envs.base.Env)")
    return lambda sample: make(**kwargs)


def _resolve(spec: str) -> Callable[..., Env]:
    import fleetrl.envs.throughput  # noqa: F401  (registers `fixed_turns`)
    import fleetrl.envs.tool_env  # noqa: F401  (registers the built-in tool environments; both import this
    # module to register, so they are imported here rather than at the top)

    if spec in ENVS:
        return ENVS[spec]
    path, sep, name = spec.rpartition(":")
    if not sep or not path.endswith(".py") or not name:
        raise EnvError(f"unknown environment {spec!r}; use a registered name {sorted(ENVS)} or "
                       "'path/to/file.py:Class'")
    module = _load_file(spec, path)
    if not callable(getattr(module, name, None)):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise EnvError(f"environment {spec!r}: {path} has no callable {name!r}; callables there: {found}")
    return getattr(module, name)


def _load_file(spec: str, path: str) -> ModuleType:
    try:
        return load_user_file(path, "fleetrl_user_env_")
    except FileNotFoundError:
        raise EnvError(f"environment {spec!r}: file {os.path.abspath(path)} does not exist (relative paths are "
                       f"resolved from {os.getcwd()})") from None
    except UserFileImportError as e:
        raise EnvError(f"environment {spec!r}: {e}") from e.cause


def _signature(fn: Callable) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(unknown)"


# ------------------------------------------------------------------------------------------ deadline calls
@dataclass(frozen=True)
class Outcome:
    """The result of one environment call: `value` on success, else `error` (and `timed_out` for a deadline)."""

    value: Any = None
    error: str | None = None
    timed_out: bool = False
    seconds: float = 0.0


class _DaemonPool:
    """Daemon worker threads reused across calls. A fresh thread per call cost ~0.1-0.2 s per turn of 256
    episodes on a loaded 2-core machine (bench/multiturn.py counts it as engine idle time); a pool reuses them.

    Invariant: every submitted task starts at once. `run_all` reserves an idle worker per task and starts a new
    thread for each one missing; a worker counts itself idle again only after its task returns, so a hung call
    (abandoned at its deadline) keeps its thread and is never handed new work. Daemon threads, like the
    one-thread-per-call design before, never block interpreter exit."""

    def __init__(self) -> None:
        self._tasks: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._started = 0

    def run_all(self, tasks: list[Callable[[], None]]) -> None:
        with self._lock:
            reserved = min(self._idle, len(tasks))
            self._idle -= reserved
            new = len(tasks) - reserved
            self._started += new
        for _ in range(new):
            threading.Thread(target=self._work, daemon=True, name="fleetrl-env").start()
        for task in tasks:
            self._tasks.put(task)

    def _work(self) -> None:
        while True:
            self._tasks.get()()  # tasks catch their own exceptions (EnvCaller.call_all)
            with self._lock:
                self._idle += 1


_POOL = _DaemonPool()


class EnvCaller:
    """Runs environment calls concurrently, each on its own daemon thread (reused, see _DaemonPool), with one
    deadline per call.

    Python cannot kill a thread: a call past its deadline is abandoned (its thread keeps running in the
    background and its late result is dropped) and the caller must not touch that environment again. Daemon
    threads keep an abandoned call from blocking interpreter exit. `timeout_s` bounds how long `call_all`
    waits; the tools' own limits (sandbox wall time) should be shorter so that a tool fault is reported as
    a tool error rather than an environment timeout.
    """

    def __init__(self, timeout_s: float = 60.0) -> None:
        if timeout_s <= 0:
            raise EnvError(f"environment timeout must be > 0 seconds, got {timeout_s}")
        self.timeout_s = timeout_s

    def call_all(self, calls: list[Callable[[], Any]]) -> list[Outcome]:
        slots: list[Outcome | None] = [None] * len(calls)
        done = [threading.Event() for _ in calls]
        start = time.monotonic()

        def run(i: int) -> None:
            t0 = time.monotonic()
            try:
                slots[i] = Outcome(value=calls[i](), seconds=time.monotonic() - t0)
            except BaseException as exc:  # noqa: BLE001 — user code: any failure is an event to count, not a crash
                # (BaseException too: a SystemExit in user code must not end a pooled worker thread silently)
                slots[i] = Outcome(error=f"{type(exc).__name__}: {exc}", seconds=time.monotonic() - t0)
            done[i].set()

        _POOL.run_all([partial(run, i) for i in range(len(calls))])
        deadline = start + self.timeout_s
        results = []
        for i in range(len(calls)):
            if done[i].wait(max(0.0, deadline - time.monotonic())):
                results.append(slots[i])
            else:
                results.append(Outcome(error=f"environment call exceeded its {self.timeout_s:g} s deadline",
                                       timed_out=True, seconds=time.monotonic() - start))
        return results


# ------------------------------------------------------------------------------------------ one-step adapter
@register_env("single_turn")
class SingleTurnEnv:
    """A reward function as a one-step environment: the first answer is scored and the episode ends.

    `scorer` is a builtin scorer name or 'path/to/file.py:fn' (fleetrl.rewards.registry); a scorer returning a
    dict contributes its "score"."""

    def __init__(self, scorer: str = "exact_match") -> None:
        self.scorer = resolve_scorer(scorer)
        self.sample: dict | None = None

    def reset(self, sample: dict) -> None:
        self.sample = sample

    def step(self, action: str) -> StepResult:
        assert self.sample is not None, "step before reset"
        return StepResult(None, score_answer(self.scorer, action, self.sample), True)


def score_answer(scorer: Callable, answer: str, sample: dict) -> float:
    result = scorer(answer, sample.get("ground_truth"), sample.get("extra_info") or {})
    return float(result["score"] if isinstance(result, dict) else result)
