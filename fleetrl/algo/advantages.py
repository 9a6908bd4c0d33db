"""Advantage estimators: from rewards (and, for GAE, critic values) to per-token advantages.

Every estimator takes one `AdvantageInputs` and returns `(advantages_BT, returns_BT)`, both zero where
`mask_BT` is 0. `returns_BT` is the regression target of a critic; estimators without a critic return
their own advantages (grpo, drgrpo, rloo) or the un-whitened return-to-go (reinforce_plus_plus*).
The trainer picks one by name: `ADVANTAGES.get(cfg.advantage)(inputs)`.

Outcome estimators (OUTCOME_ESTIMATORS: grpo, drgrpo, rloo) see only `scores_B` and ignore
`token_rewards_BT`, so a per-token KL penalty given there is silently lost; for them the penalty is folded
into the score first with `fold_kl_into_scores`.

All estimators run under `torch.no_grad()`: advantages are fixed targets for the policy update, and a
critic's values must not receive gradient through them.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from fleetrl.algo.registry import Registry
from fleetrl.algo.stats import masked_whiten


@dataclass(frozen=True, kw_only=True)
class AdvantageInputs:
    """Everything any estimator may need; each estimator reads only the fields it uses."""

    scores_B: Tensor  # [B] sequence-level reward (from the reward function)
    mask_BT: Tensor  # [B, T] response mask (1 = real token)
    group_B: Tensor  # [B] long, samples generated from the same prompt share an id
    token_rewards_BT: Tensor | None = None  # [B, T] extra per-token reward (e.g. -beta*KL); None = zeros
    values_BT: Tensor | None = None  # [B, T] critic values (GAE only)
    gamma: float = 1.0  # discount per token
    lam: float = 1.0  # GAE lambda
    norm_by_std: bool = True  # GRPO: divide by group std
    eps: float = 1e-6  # added to the group std before dividing
    sum_all: Callable[[Tensor], Tensor] | None = None
    """Sums a tensor over the data-parallel ranks when this batch is one rank's share (the rank-local step; whole
    groups, so group statistics stay local and exact); batch-wide whitening (gae, reinforce_plus_plus) reads
    global sums through it. None: this batch is the whole step's."""

    def __post_init__(self) -> None:
        if self.mask_BT.dim() != 2:
            raise ValueError(f"AdvantageInputs.mask_BT must be [B, T]; got shape {tuple(self.mask_BT.shape)}")
        B, T = self.mask_BT.shape
        expected = {"scores_B": (B,), "group_B": (B,), "token_rewards_BT": (B, T), "values_BT": (B, T)}
        for name, shape in expected.items():
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != shape:
                raise ValueError(
                    f"AdvantageInputs.{name} has shape {tuple(t.shape)}; expected {shape} to match "
                    f"mask_BT {(B, T)}"
                )

    def sequence_rewards_BT(self) -> Tensor:
        """[B, T] token_rewards (zeros if None) plus each score on its sequence's last valid token."""
        placed_BT = place_scores_on_last_token(self.scores_B, self.mask_BT)
        if self.token_rewards_BT is None:
            return placed_BT
        return placed_BT + self.token_rewards_BT * self.mask_BT


AdvantageFn = Callable[[AdvantageInputs], tuple[Tensor, Tensor]]
ADVANTAGES: Registry[AdvantageFn] = Registry("advantage estimator")

# Estimators that read only scores_B (one number per sequence) and ignore token_rewards_BT. Decided here, next
# to the estimators, so the config/trainer asks once instead of re-deriving it; tests/algo/test_advantages.py
# checks the set against what each estimator actually does with token rewards.
OUTCOME_ESTIMATORS: frozenset[str] = frozenset({"grpo", "drgrpo", "rloo", "grpo_turns"})


def is_outcome_estimator(name: str) -> bool:
    """True when estimator `name` ignores per-token rewards (a KL-in-reward penalty must be folded first)."""
    ADVANTAGES.get(name)  # an unknown name fails here, with a suggestion, rather than reading as "not outcome"
    return name in OUTCOME_ESTIMATORS


# ---------------------------------------------------------------------------------------------- helpers
def place_scores_on_last_token(scores_B: Tensor, mask_BT: Tensor) -> Tensor:
    """[B, T] zeros with scores_B[b] at the last position where mask_BT[b] is 1.

    "Last valid" rather than "sum of mask - 1" so masks with holes (multi-turn, tool output masked out)
    still reward the final generated token. A row with an empty mask gets no reward.
    """
    B, T = mask_BT.shape
    pos_BT = torch.arange(T, device=mask_BT.device).expand(B, T)
    last_B = torch.where(mask_BT.bool(), pos_BT, -1).max(dim=1).values
    scores_B = scores_B.to(torch.promote_types(scores_B.dtype, torch.float32))
    kept_B = torch.where(last_B >= 0, scores_B, torch.zeros_like(scores_B))
    out_BT = torch.zeros(B, T, dtype=scores_B.dtype, device=scores_B.device)
    return out_BT.scatter(1, last_B.clamp_min(0).unsqueeze(1), kept_B.unsqueeze(1))


@torch.no_grad()
def fold_kl_into_scores(scores_B: Tensor, kl_BT: Tensor, mask_BT: Tensor, coef: float) -> Tensor:
    """[B] score_b - coef * sum_t kl_BT[b, t] over the response tokens (mask_BT == 1) of sequence b.

    KL-in-reward for outcome estimators. PPO-style KL in the reward gives every token the reward -coef * kl_t and
    the last token the score as well; an outcome estimator only sees one number per sequence, and the sum of
    those token rewards is exactly score - coef * sum_t kl_t. This is also what verl computes for GRPO with
    `use_kl_in_reward` (its GRPO advantage sums the KL-penalised token-level rewards). kl_BT: [B, T] per-token
    estimate (e.g. `kl_estimate(logp, ref_logp, "k1")`), masked positions ignored whatever they hold.
    """
    if scores_B.shape != mask_BT.shape[:1] or kl_BT.shape != mask_BT.shape:
        raise ValueError(f"fold_kl_into_scores: scores_B {tuple(scores_B.shape)} and kl_BT {tuple(kl_BT.shape)} "
                         f"must be ({mask_BT.shape[0]},) and {tuple(mask_BT.shape)} to match mask_BT")
    kl_sum_B = torch.where(mask_BT.bool(), kl_BT, torch.zeros_like(kl_BT)).sum(dim=1)
    return scores_B - coef * kl_sum_B


def gae_advantages(
    token_rewards_BT: Tensor, values_BT: Tensor, mask_BT: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Un-whitened GAE (Schulman et al. 2016). All [B, T]; returns (advantages_BT, returns_BT).

    delta_t = r_t + gamma * V_next - V_t,  A_t = delta_t + gamma * lam * A_next, where "next" is the next
    *valid* token: masked positions are skipped, and the value after the last valid token is 0 (the
    response ended; there is no state to bootstrap from). returns = A + V, zero where masked.
    """
    valid_BT = mask_BT.bool()
    next_value_B = torch.zeros_like(values_BT[:, 0])
    next_adv_B = torch.zeros_like(values_BT[:, 0])
    adv_BT = torch.zeros_like(values_BT)
    for t in reversed(range(mask_BT.shape[1])):
        delta_B = token_rewards_BT[:, t] + gamma * next_value_B - values_BT[:, t]
        adv_B = delta_B + gamma * lam * next_adv_B
        # Masked tokens neither get an advantage nor break the chain between the valid ones around them.
        next_adv_B = torch.where(valid_BT[:, t], adv_B, next_adv_B)
        next_value_B = torch.where(valid_BT[:, t], values_BT[:, t], next_value_B)
        adv_BT[:, t] = torch.where(valid_BT[:, t], adv_B, torch.zeros_like(adv_B))
    returns_BT = torch.where(valid_BT, adv_BT + values_BT, torch.zeros_like(adv_BT))
    return adv_BT, returns_BT


def discounted_returns(rewards_BT: Tensor, mask_BT: Tensor, gamma: float) -> Tensor:
    """[B, T] return-to-go G_t = r_t + gamma * G_next over valid tokens (masked ones skipped, zero)."""
    valid_BT = mask_BT.bool()
    running_B = torch.zeros_like(rewards_BT[:, 0])
    out_BT = torch.zeros_like(rewards_BT)
    for t in reversed(range(mask_BT.shape[1])):
        running_B = torch.where(valid_BT[:, t], rewards_BT[:, t] + gamma * running_B, running_B)
        out_BT[:, t] = torch.where(valid_BT[:, t], running_B, torch.zeros_like(running_B))
    return out_BT


def group_stats(scores_B: Tensor, group_B: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample (mean_B, std_B, count_B) of the scores of its group.

    Group ids need not be contiguous or sorted. std is unbiased (like torch.std) and 0 for a group of
    one, where the unbiased estimate is undefined.
    """
    scores_B = scores_B.to(torch.promote_types(scores_B.dtype, torch.float32))
    _, inv_B = torch.unique(group_B, return_inverse=True)
    zeros_G = scores_B.new_zeros(int(inv_B.max()) + 1 if inv_B.numel() else 0)
    count_G = zeros_G.index_add(0, inv_B, torch.ones_like(scores_B))
    mean_B = (zeros_G.index_add(0, inv_B, scores_B) / count_G)[inv_B]
    sq_G = zeros_G.index_add(0, inv_B, (scores_B - mean_B) ** 2)
    std_B = (sq_G / (count_G - 1).clamp_min(1)).sqrt()[inv_B]
    return mean_B, std_B, count_G[inv_B]


def _broadcast(adv_B: Tensor, mask_BT: Tensor) -> tuple[Tensor, Tensor]:
    """Sequence-level advantage to every valid token; returns (adv_BT, adv_BT)."""
    adv_BT = torch.where(mask_BT.bool(), adv_B.unsqueeze(1), torch.zeros_like(adv_B).unsqueeze(1))
    return adv_BT, adv_BT


# ------------------------------------------------------------------------------------------- estimators
@ADVANTAGES.register("gae")
@torch.no_grad()
def gae(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """PPO's GAE: score on the last valid token plus token_rewards, GAE with the critic's values_BT,
    advantages whitened over the whole batch. Returns are un-whitened A + V (the critic's target)."""
    if inputs.values_BT is None:
        raise ValueError("advantage estimator 'gae' needs values_BT from a critic; enable the critic or "
                         "choose a critic-free estimator such as 'grpo' or 'rloo'")
    rewards_BT = inputs.sequence_rewards_BT()
    adv_BT, returns_BT = gae_advantages(rewards_BT, inputs.values_BT, inputs.mask_BT, inputs.gamma, inputs.lam)
    return masked_whiten(adv_BT, inputs.mask_BT, sum_all=inputs.sum_all), returns_BT


@ADVANTAGES.register("grpo")
@torch.no_grad()
def grpo(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """GRPO (Shao et al. 2024): (score - group mean) / (group std + eps), same value on every token.

    norm_by_std=False only centres. A group of one gets 0. Ignores token_rewards_BT, gamma and lam.
    """
    mean_B, std_B, _ = group_stats(inputs.scores_B, inputs.group_B)
    adv_B = inputs.scores_B - mean_B
    if inputs.norm_by_std:
        adv_B = adv_B / (std_B + inputs.eps)
    return _broadcast(adv_B, inputs.mask_BT)


def turn_index(mask_BT: Tensor) -> Tensor:
    """[B, T] long: k on the tokens of the k-th run of 1s of mask_BT (the k-th model turn), -1 where it is 0.

    A multi-turn rollout's loss_mask is 1 on model tokens and 0 on the environment's, and every observation
    adds at least the next turn's generation prompt, so each model turn is exactly one run of 1s."""
    valid_BT = mask_BT.bool()
    before_BT = torch.cat([torch.zeros_like(valid_BT[:, :1]), valid_BT[:, :-1]], dim=1)
    runs_BT = (valid_BT & ~before_BT).long().cumsum(dim=1) - 1
    return torch.where(valid_BT, runs_BT, torch.full_like(runs_BT, -1))


@ADVANTAGES.register("grpo_turns")
@torch.no_grad()
def grpo_turns(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """GRPO with one baseline per turn: the tokens of turn k get (score - mean) / (std + eps) over the episodes
    of their group that reached turn k (turns from `turn_index(mask_BT)`). One turn per row: exactly `grpo`.

    Why. With an outcome score the return of every turn is the episode's score, so GRPO's only per-token
    choice is the baseline, and its one group-wide baseline mixes states: when few episodes of a group call
    a tool, the callers' answers are compared with the non-callers' and inherit the call's shaping bonus as a
    large advantage, whatever digit they answered (docs/envs.md "The learning test"). Comparing a turn with the
    same turn of its siblings removes whatever every reacher shares (that bonus) and leaves the answer's own
    credit. The baseline is still independent of the turn's action, so the gradient stays unbiased; rewards
    earned in earlier turns that differ between reachers only add variance. Related: MT-GRPO's turn-level
    advantages (Zeng et al. 2025, arXiv:2505.11821), which normalise per-turn rewards per turn the same way.
    Ignores token_rewards_BT, gamma and lam.
    """
    turn_BT = turn_index(inputs.mask_BT)
    adv_BT = torch.zeros(inputs.mask_BT.shape, dtype=torch.promote_types(inputs.scores_B.dtype, torch.float32),
                         device=inputs.mask_BT.device)
    for k in range(int(turn_BT.max()) + 1 if turn_BT.numel() else 0):
        at_BT = turn_BT == k
        rows_B = at_BT.any(dim=1)
        scores_R = inputs.scores_B[rows_B]
        mean_R, std_R, _ = group_stats(scores_R, inputs.group_B[rows_B])
        adv_R = scores_R - mean_R
        if inputs.norm_by_std:
            adv_R = adv_R / (std_R + inputs.eps)
        adv_BT[rows_B] = torch.where(at_BT[rows_B], adv_R.unsqueeze(1).to(adv_BT.dtype), adv_BT[rows_B])
    return adv_BT, adv_BT


@ADVANTAGES.register("drgrpo")
@torch.no_grad()
def drgrpo(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """Dr.GRPO (Liu et al. 2025): score - group mean, never divided by the std, whatever norm_by_std says.

    Dividing by the std up-weights prompts that are almost always solved or failed (tiny std); Dr.GRPO
    drops it to remove that difficulty bias. Pair with aggregation 'seq-mean-token-sum-norm' to also
    remove the length bias. Ignores token_rewards_BT, gamma and lam.
    """
    mean_B, _, _ = group_stats(inputs.scores_B, inputs.group_B)
    return _broadcast(inputs.scores_B - mean_B, inputs.mask_BT)


@ADVANTAGES.register("rloo")
@torch.no_grad()
def rloo(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """RLOO (Ahmadian et al. 2024): score_i - mean of the *other* samples of its group; 0 for n = 1.

    Uses score_i - (sum - score_i) / (n - 1) == n / (n - 1) * (score_i - mean). The baseline excludes the
    sample itself, so it stays unbiased. Ignores token_rewards_BT, gamma and lam.
    """
    mean_B, _, count_B = group_stats(inputs.scores_B, inputs.group_B)
    adv_B = (inputs.scores_B - mean_B) * count_B / (count_B - 1).clamp_min(1)
    return _broadcast(adv_B, inputs.mask_BT)


@ADVANTAGES.register("reinforce_plus_plus")
@torch.no_grad()
def reinforce_plus_plus(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025): token_rewards + score on the last valid token, return-to-go with gamma,
    advantages = return-to-go whitened over the whole batch (not per group). Returns are un-whitened."""
    returns_BT = discounted_returns(inputs.sequence_rewards_BT(), inputs.mask_BT, inputs.gamma)
    return masked_whiten(returns_BT, inputs.mask_BT, sum_all=inputs.sum_all), returns_BT


@ADVANTAGES.register("reinforce_plus_plus_baseline")
@torch.no_grad()
def reinforce_plus_plus_baseline(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline: subtract the group mean of the scores, then as reinforce_plus_plus.

    The group mean removes per-prompt difficulty; the global whitening that follows (instead of GRPO's
    per-group std) keeps the advantage scale stable when a group's std is near 0.
    """
    mean_B, _, _ = group_stats(inputs.scores_B, inputs.group_B)
    centred = AdvantageInputs(
        scores_B=inputs.scores_B - mean_B, mask_BT=inputs.mask_BT, group_B=inputs.group_B,
        token_rewards_BT=inputs.token_rewards_BT, gamma=inputs.gamma, sum_all=inputs.sum_all,
    )
    return reinforce_plus_plus(centred)
