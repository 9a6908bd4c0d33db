"""The controller's own checkpointed state, as `Stateful` objects the checkpoint manager saves and loads without
knowing the trainer (state_dict / load_state_dict, like torchtitan's components)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fleetrl.workers.state import rng_state, set_rng_state


@dataclass
class Progress:
    step: int = 0
    """RL steps finished."""
    weights_version: int = 0
    """Version of the actor weights the rollout engines must hold (bumped by every sync)."""
    sync_baseline: float | None = None
    """The policy check's baseline (engines/sync_check.py): the probe's first gap, before any update, or with
    source=step the largest gap of the last 10 steps; kept so that a resume is checked against the run's own
    baseline rather than against whatever its first sync shows."""

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "weights_version": self.weights_version, "sync_baseline": self.sync_baseline}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.weights_version = int(state["step"]), int(state["weights_version"])
        self.sync_baseline = state.get("sync_baseline")  # None in checkpoints from before the check


class RNGState:
    """The driver process's python/numpy/torch generators."""

    def state_dict(self) -> dict[str, Any]:
        return rng_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_rng_state(state)
