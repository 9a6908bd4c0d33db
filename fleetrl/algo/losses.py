"""Loss terms of the policy/critic update, and how per-token losses become one scalar.

Every loss returns a per-token [B, T] quantity reduced by `aggregate(..., mode=agg)`, so the aggregation
(token-mean, per-sequence means, Dr.GRPO's constant normaliser) is chosen independently of the loss.
Metrics are detached scalars, masked means over the valid tokens of the (micro-)batch given.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

from fleetrl.algo.kl import kl_estimate
from fleetrl.algo.registry import Registry
from fleetrl.algo.stats import masked_mean, masked_sum

# ------------------------------------------------------------------------------------------ aggregation
Count = float | Tensor  # a count passed in by the trainer, or one computed here from the mask
AggregationFn = Callable[[Tensor, Tensor, Count, Count, float | None], Tensor]
AGGREGATIONS: Registry[AggregationFn] = Registry("loss aggregation")


@AGGREGATIONS.register("token-mean")
def _token_mean(
    loss_BT: Tensor, mask_BT: Tensor, num_tokens: Count, num_seqs: Count, norm_len: float | None
) -> Tensor:
    # Every token weighs the same: long responses dominate the gradient (DAPO's choice).
    return masked_sum(loss_BT, mask_BT) / num_tokens


@AGGREGATIONS.register("seq-mean-token-sum")
def _seq_mean_token_sum(
    loss_BT: Tensor, mask_BT: Tensor, num_tokens: Count, num_seqs: Count, norm_len: float | None
) -> Tensor:
    return masked_sum(loss_BT, mask_BT, dim=1).sum() / num_seqs


@AGGREGATIONS.register("seq-mean-token-mean")
def _seq_mean_token_mean(
    loss_BT: Tensor, mask_BT: Tensor, num_tokens: Count, num_seqs: Count, norm_len: float | None
) -> Tensor:
    # Original GRPO: every sequence weighs the same, so each token of a long response weighs less.
    return masked_mean(loss_BT, mask_BT, dim=1).sum() / num_seqs


@AGGREGATIONS.register("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(
    loss_BT: Tensor, mask_BT: Tensor, num_tokens: Count, num_seqs: Count, norm_len: float | None
) -> Tensor:
    # Dr.GRPO: a constant normaliser (max response length) removes the length bias of per-sequence means.
    if norm_len is None:
        raise ValueError("aggregation 'seq-mean-token-sum-norm' needs norm_len (the max response length, "
                         "e.g. the rollout's max_new_tokens); pass norm_len=...")
    return masked_sum(loss_BT, mask_BT) / (num_seqs * norm_len)


def aggregate(
    loss_BT: Tensor,
    mask_BT: Tensor,
    mode: str,
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    norm_len: float | None = None,
) -> Tensor:
    """Scalar from a per-token loss. loss_BT, mask_BT: [B, T]; mode: a name in AGGREGATIONS.

    num_tokens / num_seqs default to this call's own counts (mask_BT.sum() and B). Why they are parameters:
    under data parallelism and gradient accumulation each rank sees micro-batches, and a mean of per-micro-
    batch means is not the full-batch mean when micro-batches hold different numbers of tokens. Passing the
    GLOBAL counts (tokens / sequences of the whole mini-batch, over all ranks) makes every mode a plain sum
    divided by a constant, so summing the micro-batch losses over ranks (gradient all-reduce with SUM)
    gives exactly the full-batch loss: DP=2 equals DP=1.
    """
    fn = AGGREGATIONS.get(mode)
    if num_tokens is None:
        num_tokens = masked_sum(torch.ones_like(loss_BT), mask_BT).clamp_min(1)
    if num_seqs is None:
        num_seqs = loss_BT.shape[0]
    return fn(loss_BT, mask_BT, num_tokens, num_seqs, norm_len)


# ------------------------------------------------------------------------------------------ policy loss
class PolicyLossFn(Protocol):
    """Shared signature of POLICY_LOSSES entries, so the trainer can call any of them the same way."""

    def __call__(
        self, logp_BT: Tensor, old_logp_BT: Tensor, adv_BT: Tensor, mask_BT: Tensor, *,
        clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None, agg: str = "token-mean",
        num_tokens: float | None = None, num_seqs: float | None = None, norm_len: float | None = None,
        is_weights_BT: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]: ...


POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")

# A log-ratio beyond +-20 only happens with broken old log-probs; clamping keeps exp() finite so the
# loss stays usable (and the clip / dual clip can still bound it) instead of turning into inf/NaN.
_LOG_RATIO_CLAMP = 20.0


def _weighted(loss_BT: Tensor, is_weights_BT: Tensor | None) -> Tensor:
    # Per-token importance weights (rollout-mismatch correction, `fleetrl.algo.correction`) scale each token's
    # loss; they are constants (no gradient). None leaves the loss untouched, bit for bit.
    return loss_BT if is_weights_BT is None else loss_BT * is_weights_BT.detach()


def _ratio(logp_BT: Tensor, old_logp_BT: Tensor) -> Tensor:
    return torch.exp((logp_BT - old_logp_BT).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))


def _ratio_metrics(logp_BT: Tensor, old_logp_BT: Tensor, ratio_BT: Tensor, mask_BT: Tensor) -> dict[str, Tensor]:
    # approx_kl is k3 of KL(pi_old || pi_theta): ratio - 1 - log ratio. The tokens were sampled from
    # pi_old, and k3 is unbiased for the KL *from the sampling distribution*, hence this direction.
    approx_kl_BT = kl_estimate(old_logp_BT.detach(), logp_BT.detach(), "k3")
    return {
        "approx_kl": masked_mean(approx_kl_BT, mask_BT),
        "ratio_mean": masked_mean(ratio_BT.detach(), mask_BT),
    }


@POLICY_LOSSES.register("ppo")
def ppo_policy_loss(
    logp_BT: Tensor, old_logp_BT: Tensor, adv_BT: Tensor, mask_BT: Tensor, *,
    clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None, agg: str = "token-mean",
    num_tokens: float | None = None, num_seqs: float | None = None, norm_len: float | None = None,
    is_weights_BT: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate. All tensors [B, T]; returns (scalar loss, metrics).

    ratio = exp(logp - old_logp); loss = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high)).
    clip_high > clip_low is DAPO's "clip-higher" (room for low-probability tokens to grow).
    dual_clip (Ye et al. 2020, > 1): for A < 0 the loss is further capped at -A * dual_clip, because the
    max above is unbounded in the ratio when A < 0 and one stale token could dominate the batch.
    Metrics: clip_frac (tokens where the clipped branch is the max), dual_clip_frac, approx_kl (k3 of
    KL(pi_old || pi_theta)), ratio_mean. is_weights_BT (all policy losses): optional [B, T] constant weights
    multiplying each token's loss before aggregation (rollout-mismatch correction); None changes nothing.
    """
    ratio_BT = _ratio(logp_BT, old_logp_BT)
    loss_BT, metrics = _clipped_surrogate(ratio_BT, adv_BT, mask_BT, clip_low, clip_high, dual_clip)
    metrics.update(_ratio_metrics(logp_BT, old_logp_BT, ratio_BT, mask_BT))
    loss = aggregate(_weighted(loss_BT, is_weights_BT), mask_BT, agg, num_tokens=num_tokens, num_seqs=num_seqs,
                     norm_len=norm_len)
    return loss, metrics


def _clipped_surrogate(
    ratio_BT: Tensor, adv_BT: Tensor, mask_BT: Tensor, clip_low: float, clip_high: float, dual_clip: float | None
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token max(-A * ratio, -A * clip(ratio)), optionally dual-clipped; (loss_BT, clip metrics)."""
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (it caps the loss at -A * dual_clip); got {dual_clip}. "
                         "Use e.g. 3.0, or None to disable")
    unclipped_BT = -adv_BT * ratio_BT
    clipped_BT = -adv_BT * torch.clamp(ratio_BT, 1.0 - clip_low, 1.0 + clip_high)
    loss_BT = torch.maximum(unclipped_BT, clipped_BT)
    metrics = {"clip_frac": masked_mean((clipped_BT > unclipped_BT).float(), mask_BT)}
    dual_active_BT = torch.zeros_like(mask_BT, dtype=torch.bool)
    if dual_clip is not None:
        cap_BT = -adv_BT * dual_clip
        dual_active_BT = (adv_BT < 0) & (loss_BT > cap_BT)
        loss_BT = torch.where(dual_active_BT, cap_BT, loss_BT)
    metrics["dual_clip_frac"] = masked_mean(dual_active_BT.float(), mask_BT)
    return loss_BT, metrics


@POLICY_LOSSES.register("vanilla_pg")
def vanilla_pg_loss(
    logp_BT: Tensor, old_logp_BT: Tensor, adv_BT: Tensor, mask_BT: Tensor, *,
    clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None, agg: str = "token-mean",
    num_tokens: float | None = None, num_seqs: float | None = None, norm_len: float | None = None,
    is_weights_BT: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Unclipped policy gradient, loss = -A * ratio. All tensors [B, T]; clip arguments are ignored.

    On-policy (ratio == 1) its gradient is REINFORCE's -A * grad(logp); off-policy it is the plain
    importance-weighted estimate. clip_frac and dual_clip_frac are reported as 0 for uniform logging.
    """
    ratio_BT = _ratio(logp_BT, old_logp_BT)
    loss = aggregate(_weighted(-adv_BT * ratio_BT, is_weights_BT), mask_BT, agg, num_tokens=num_tokens,
                     num_seqs=num_seqs, norm_len=norm_len)
    zero = torch.zeros((), device=logp_BT.device)
    metrics = {"clip_frac": zero, "dual_clip_frac": zero}
    metrics.update(_ratio_metrics(logp_BT, old_logp_BT, ratio_BT, mask_BT))
    return loss, metrics


@POLICY_LOSSES.register("gspo")
def gspo_policy_loss(
    logp_BT: Tensor, old_logp_BT: Tensor, adv_BT: Tensor, mask_BT: Tensor, *,
    clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None, agg: str = "token-mean",
    num_tokens: float | None = None, num_seqs: float | None = None, norm_len: float | None = None,
    is_weights_BT: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"), in the paper's GSPO-token form. [B, T].

    s_b  = exp(mean over b's response tokens of (logp - old_logp))   sequence ratio, length-normalised
    s_bt = sg(s_b) * exp(logp_bt - sg(logp_bt))                     value s_b, gradient s_b * grad logp_bt
    loss_bt = max(-A_bt * s_bt, -A_bt * clip(s_bt, 1 - clip_low, 1 + clip_high)), dual clip as in 'ppo'.
    Clipping acts on whole sequences (every token of b shares s_b). With one advantage per sequence and
    agg="seq-mean-token-mean" (the paper's 1/G sum_b 1/|y_b| sum_t) the gradient is exactly that of sequence-
    level GSPO, s_b / |y_b| * A_b * grad sum_t logp_bt; other aggregations weight sequences differently.
    The paper clips at clip_low=3e-4, clip_high=4e-4, far tighter than PPO's 0.2, because a geometric mean of
    token ratios stays much closer to 1; set algorithm.clip_low/clip_high accordingly.
    Metrics as 'ppo'; clip_frac counts tokens (sequences weighted by length), ratio_mean is the mean of s_b.
    """
    seq_log_ratio_B = masked_mean(logp_BT - old_logp_BT, mask_BT, dim=1).detach()
    seq_ratio_B1 = torch.exp(seq_log_ratio_B.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)).unsqueeze(1)
    # exp(logp - sg(logp)) is exactly 1 in value and carries d/dlogp = 1: the token-level gradient path.
    ratio_BT = seq_ratio_B1 * torch.exp(logp_BT - logp_BT.detach())
    loss_BT, metrics = _clipped_surrogate(ratio_BT, adv_BT, mask_BT, clip_low, clip_high, dual_clip)
    metrics.update(_ratio_metrics(logp_BT, old_logp_BT, ratio_BT, mask_BT))
    loss = aggregate(_weighted(loss_BT, is_weights_BT), mask_BT, agg, num_tokens=num_tokens, num_seqs=num_seqs,
                     norm_len=norm_len)
    return loss, metrics


@POLICY_LOSSES.register("cispo")
def cispo_policy_loss(
    logp_BT: Tensor, old_logp_BT: Tensor, adv_BT: Tensor, mask_BT: Tensor, *,
    clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None, agg: str = "token-mean",
    num_tokens: float | None = None, num_seqs: float | None = None, norm_len: float | None = None,
    is_weights_BT: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax 2025, "MiniMax-M1", sec. 3.1): loss_bt = -sg(clip(ratio_bt, 1 - clip_low, 1 + clip_high))
    * A_bt * logp_bt. All tensors [B, T].

    PPO zeroes the gradient of clipped tokens, which in long reasoning drops the rare "fork" tokens whose ratio
    moves most; CISPO clips the importance weight instead and treats it as a constant, so every token keeps a
    REINFORCE gradient -w * A * grad logp with w bounded. The paper bounds w from above only (no lower bound);
    clip_low=1.0 reproduces that (w >= 0). The loss VALUE depends on logp and is not comparable with 'ppo''s;
    its gradient is what matters. dual_clip is ignored (w is already bounded), dual_clip_frac reported as 0.
    Metrics: clip_frac = tokens whose weight was truncated; approx_kl, ratio_mean as 'ppo'.
    """
    ratio_BT = _ratio(logp_BT, old_logp_BT)
    weight_BT = torch.clamp(ratio_BT, 1.0 - clip_low, 1.0 + clip_high).detach()
    loss_BT = -adv_BT * weight_BT * logp_BT
    truncated_BT = (ratio_BT < 1.0 - clip_low) | (ratio_BT > 1.0 + clip_high)
    metrics = {"clip_frac": masked_mean(truncated_BT.float(), mask_BT),
               "dual_clip_frac": torch.zeros((), device=logp_BT.device)}
    metrics.update(_ratio_metrics(logp_BT, old_logp_BT, ratio_BT, mask_BT))
    loss = aggregate(_weighted(loss_BT, is_weights_BT), mask_BT, agg, num_tokens=num_tokens, num_seqs=num_seqs,
                     norm_len=norm_len)
    return loss, metrics


# -------------------------------------------------------------------------------------- critic, KL, entropy
def value_loss(
    values_BT: Tensor, old_values_BT: Tensor, returns_BT: Tensor, mask_BT: Tensor, *,
    clip: float | None = 0.2, agg: str = "token-mean",
    num_tokens: float | None = None, num_seqs: float | None = None, norm_len: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Critic loss 0.5 * max((v - R)^2, (clip(v, old - clip, old + clip) - R)^2). All tensors [B, T].

    The clipped term keeps the critic near the values the advantages were computed with; taking the
    max makes it pessimistic. clip=None gives the plain 0.5 * (v - R)^2. Metric: vf_clip_frac.
    """
    unclipped_BT = (values_BT - returns_BT) ** 2
    if clip is None:
        loss_BT, active_BT = unclipped_BT, torch.zeros_like(mask_BT, dtype=torch.bool)
    else:
        v_clipped_BT = torch.clamp(values_BT, old_values_BT - clip, old_values_BT + clip)
        clipped_BT = (v_clipped_BT - returns_BT) ** 2
        loss_BT, active_BT = torch.maximum(unclipped_BT, clipped_BT), clipped_BT > unclipped_BT
    loss = aggregate(0.5 * loss_BT, mask_BT, agg, num_tokens=num_tokens, num_seqs=num_seqs, norm_len=norm_len)
    return loss, {"vf_clip_frac": masked_mean(active_BT.float(), mask_BT)}


def kl_loss(
    logp_BT: Tensor, ref_logp_BT: Tensor, mask_BT: Tensor, *,
    kind: str = "k3", agg: str = "token-mean",
    num_tokens: float | None = None, num_seqs: float | None = None, norm_len: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL to the reference as a loss term (GRPO style); the trainer adds coef * loss. Tensors [B, T].

    Which estimator matters for the gradient: in expectation, k1 gives zero gradient, k2 that of
    KL(pi || ref), k3 that of KL(ref || pi). Metric: kl (masked mean of the estimate).
    """
    kl_BT = kl_estimate(logp_BT, ref_logp_BT, kind)
    loss = aggregate(kl_BT, mask_BT, agg, num_tokens=num_tokens, num_seqs=num_seqs, norm_len=norm_len)
    return loss, {"kl": masked_mean(kl_BT.detach(), mask_BT)}


def entropy_from_logits(logits_BTV: Tensor) -> Tensor:
    """[B, T] entropy of softmax(logits_BTV) over the vocabulary V.

    H = logsumexp(z) - sum(softmax(z) * z): no log of a probability, so no log(0) for tiny probabilities.
    """
    # H is shift-invariant; subtracting the max first keeps both terms small, so their difference does not
    # lose float32 digits when logits are large (at |z| ~ 1000 the float32 spacing is ~6e-5).
    logits_BTV = logits_BTV - logits_BTV.max(dim=-1, keepdim=True).values.detach()
    probs_BTV = torch.softmax(logits_BTV, dim=-1)
    # -inf logits (top-k / vocab masking) have p = 0; 0 * -inf would be NaN, their true term is 0.
    p_times_z_BTV = torch.where(probs_BTV > 0, probs_BTV * logits_BTV, torch.zeros_like(probs_BTV))
    return torch.logsumexp(logits_BTV, dim=-1) - p_times_z_BTV.sum(dim=-1)


def entropy_loss(
    entropy_BT: Tensor, mask_BT: Tensor, *, agg: str = "token-mean",
    num_tokens: float | None = None, num_seqs: float | None = None, norm_len: float | None = None,
) -> Tensor:
    """Aggregated entropy (scalar) of entropy_BT [B, T]; the trainer subtracts coef * this from the loss."""
    return aggregate(entropy_BT, mask_BT, agg, num_tokens=num_tokens, num_seqs=num_seqs, norm_len=norm_len)


@torch.no_grad()
def apply_kl_penalty(
    scores_B: Tensor, logp_BT: Tensor, ref_logp_BT: Tensor, mask_BT: Tensor, coef: float, kind: str
) -> tuple[Tensor, Tensor]:
    """KL as a reward penalty (PPO/RLHF style). Returns (token_rewards_BT, kl_BT), both [B, T], masked.

    token_rewards = -coef * kl. scores_B [B] is only checked against the batch size and NOT added: the
    advantage estimator places the score on the last token itself (AdvantageInputs.token_rewards_BT),
    and adding it here too would count it twice. Outcome estimators (advantages.OUTCOME_ESTIMATORS) ignore
    token rewards: fold the returned kl_BT into the scores with `fold_kl_into_scores` instead.
    """
    if scores_B.shape != mask_BT.shape[:1]:
        raise ValueError(f"scores_B has shape {tuple(scores_B.shape)}; expected ({mask_BT.shape[0]},) to "
                         f"match mask_BT {tuple(mask_BT.shape)}")
    kl_BT = kl_estimate(logp_BT, ref_logp_BT, kind)
    kl_BT = torch.where(mask_BT.bool(), kl_BT, torch.zeros_like(kl_BT))
    return -coef * kl_BT, kl_BT
