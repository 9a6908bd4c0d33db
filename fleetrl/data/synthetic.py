"""Registry of synthetic tasks: generators selected by a `synthetic:NAME?key=val&...` data spec.

A generator takes the query parameters as keyword arguments, each converted to the type the generator
declares for it (annotation, else its default's type; an undeclared one to int, float or bool where it looks
like one), so `n=abc` for `n: int` is a DataError naming the parameter. A generator raises ValueError, naming
the parameter, for a value it cannot use (`split=foo`); the user sees it as a DataError naming the spec.
It returns rows in the verl schema (`data_source`, `prompt`,
`reward_model.ground_truth`, ...), which then go through the same normalisation as rows read from files.
"""
from __future__ import annotations

from typing import Callable

SyntheticTask = Callable[..., list[dict]]

SYNTHETIC_TASKS: dict[str, SyntheticTask] = {}


def register_synthetic(name: str) -> Callable[[SyntheticTask], SyntheticTask]:
    """Decorator: `@register_synthetic("countdown")` makes `synthetic:countdown?n=100` load that generator."""

    def add(fn: SyntheticTask) -> SyntheticTask:
        if name in SYNTHETIC_TASKS and SYNTHETIC_TASKS[name] is not fn:
            raise ValueError(f"synthetic task {name!r} is already registered by {SYNTHETIC_TASKS[name]!r}")
        SYNTHETIC_TASKS[name] = fn
        return fn

    return add
