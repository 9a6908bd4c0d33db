"""How reward-model scores join rule rewards, and the optional running normalisation of RM scores.

Per sample i of data_source s with weights (w_rule, w_model) = rewards.combine[s]:
    score_i = w_rule · rule_i + w_model · rm_i
where rm_i is the raw RM score, or (rm_i − μ) / σ with μ, σ the running mean/std of every RM score seen so far
(this step's included) when rewards.model.normalize is on.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from fleetrl.config.reward_model import CombineWeights


def combine_scores(rule_B: torch.Tensor, model_B: torch.Tensor, sources: Sequence[str],
                   weights_of: Callable[[str], CombineWeights]) -> torch.Tensor:
    """[B] combined scores (float32) from [B] rule and [B] model scores and each sample's data_source."""
    w = [weights_of(str(s)) for s in sources]
    w_rule = torch.tensor([x.rule for x in w], dtype=torch.float32)
    w_model = torch.tensor([x.model for x in w], dtype=torch.float32)
    return w_rule * rule_B.float() + w_model * model_B.float()


class RunningNorm:
    """Running mean/variance over all values seen (Chan et al.'s parallel update of Welford's algorithm), a
    checkpointed Stateful: a resumed run normalises exactly as a straight one would."""

    def __init__(self, eps: float = 1e-6) -> None:
        self.count, self.mean, self.m2, self.eps = 0, 0.0, 0.0, eps

    def update(self, x_B: torch.Tensor) -> None:
        n = int(x_B.numel())
        if n == 0:
            return
        x = x_B.double()
        b_mean, b_m2 = float(x.mean()), float(((x - x.mean()) ** 2).sum())
        total = self.count + n
        delta = b_mean - self.mean
        self.mean += delta * n / total
        self.m2 += b_m2 + delta * delta * self.count * n / total
        self.count = total

    @property
    def std(self) -> float:
        return (self.m2 / self.count) ** 0.5 if self.count else 1.0

    def normalize(self, x_B: torch.Tensor) -> torch.Tensor:
        """Updates with x, then standardises x by the updated statistics."""
        self.update(x_B)
        return ((x_B.double() - self.mean) / max(self.std, self.eps)).float()

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict) -> None:
        self.count, self.mean, self.m2 = int(state["count"]), float(state["mean"]), float(state["m2"])
