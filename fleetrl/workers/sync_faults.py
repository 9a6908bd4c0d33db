"""Fault injection for the policy check's tests (engines/sync_check.py): a weight sync that silently skips tensors.

FLEETRL_FAULT_SYNC_SKIP=PAT[,PAT...]   tensors whose name contains one of the PATs never reach the rollout engine:
  separate pool: `Worker.install_weights` replaces them in what arrived by the engine's own, which so keeps its
  start-up values;
  colocated: the engine decodes with their start-up values (a copy taken when the rollout was built, swapped in
  around each engine call), as an engine whose own copy of them is never refreshed would.
A no-op unless the variable is set (cluster.env carries it to Ray workers), like heartbeat's FLEETRL_FAULT_* hooks.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Callable, Iterator, Mapping

import torch

ENV = "FLEETRL_FAULT_SYNC_SKIP"


def skipped_patterns() -> tuple[str, ...]:
    return tuple(p for p in os.environ.get(ENV, "").split(",") if p)


def skip_received(received: dict[str, torch.Tensor], own: Callable[[], Mapping[str, torch.Tensor]]
                  ) -> dict[str, torch.Tensor]:
    """Separate pool: what arrived, with each skipped tensor replaced by the engine's own current one (its stale
    value; `own` gives the engine model's state), so that even a loader that checks every name is satisfied."""
    pats = skipped_patterns()
    if not pats:
        return received
    mine = own()
    return {n: mine[n] if any(p in n for p in pats) else t for n, t in received.items()}


class StaleView:
    """Colocated: start-up copies of the skipped parameters, swapped into the model around each engine call."""

    def __init__(self, model: torch.nn.Module) -> None:
        pats = skipped_patterns()
        seen: set[int] = set()
        self.params: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        for name, p in model.named_parameters(remove_duplicate=False):  # a tied head is found under either name
            if any(s in name for s in pats) and id(p) not in seen:
                seen.add(id(p))
                self.params.append((p, p.detach().clone()))

    @contextmanager
    def swapped(self) -> Iterator[None]:
        live = [p.data for p, _ in self.params]
        for p, stale in self.params:
            p.data = stale
        try:
            yield
        finally:
            for (p, _), data in zip(self.params, live):
                p.data = data
