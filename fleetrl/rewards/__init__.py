"""Rewards: scorer functions, a registry and data_source router, and a runner with timeouts."""
from fleetrl.rewards.errors import RewardError
from fleetrl.rewards.registry import SCORERS, RewardRouter, resolve_scorer
from fleetrl.rewards.runner import RewardResult, RewardRunner
from fleetrl.rewards.scorers import make_format_scorer

__all__ = ["SCORERS", "RewardError", "RewardResult", "RewardRouter", "RewardRunner", "make_format_scorer",
           "resolve_scorer"]
