"""Reward error types: a configuration problem the user can fix, and a scorer that stopped working mid-run."""
from __future__ import annotations

from fleetrl.errors import UserError


class RewardError(UserError, ValueError):
    """A reward setting is wrong; the message says what was found, what was expected and what to change."""


class ScorerFailureError(RewardError):
    """A scorer failed (error, timeout or hung) on more than rewards.max_failure_rate of its samples in one
    batch. Training on default scores would teach nothing, so the run stops; the message names the scorer, its
    data sources, the counts and the first error. Not recoverable by a restart: the scorer needs fixing."""
