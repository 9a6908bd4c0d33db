"""Name -> implementation tables for the algorithm variants a config can pick.

Configs name an advantage estimator, a policy loss, a KL estimator, ... by string; the trainer resolves each
name once at config load with `Registry.get`, so a typo fails before any GPU is touched, with a suggestion.
"""
from __future__ import annotations

import difflib
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """A named table of implementations of one kind (e.g. kind="advantage estimator").

    Usage:
        ADVANTAGES: Registry[AdvantageFn] = Registry("advantage estimator")

        @ADVANTAGES.register("grpo")
        def grpo(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]: ...

        fn = ADVANTAGES.get(cfg.algo.advantage)
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator adding the decorated object under `name`; returns the object unchanged."""

        def add(obj: T) -> T:
            # Silent overwrites would let an experiment replace a core entry by accident.
            if name in self._entries:
                raise ValueError(f"{self.kind} '{name}' is already registered; pick another name")
            self._entries[name] = obj
            return obj

        return add

    def get(self, name: str) -> T:
        """The entry called `name`; ValueError naming the closest known entry when there is none."""
        if name in self._entries:
            return self._entries[name]
        known = ", ".join(self.names())
        close = difflib.get_close_matches(name, self.names(), n=1)
        hint = f"; did you mean '{close[0]}'? known: " if close else "; known: "
        raise ValueError(f"unknown {self.kind} '{name}'{hint}{known}")

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"
