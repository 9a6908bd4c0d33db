"""Algorithm math of fleetrl: advantage estimators, policy/critic/KL/entropy losses, KL control.

Pure torch functions on padded [B, T] tensors, chosen by name from registries at config load:
    ADVANTAGES.get("grpo"), POLICY_LOSSES.get("ppo"), AGGREGATIONS.get("token-mean"), KL_ESTIMATORS.get("k3").
"""
from fleetrl.algo.advantages import (
    ADVANTAGES,
    OUTCOME_ESTIMATORS,
    AdvantageInputs,
    discounted_returns,
    fold_kl_into_scores,
    gae_advantages,
    group_stats,
    is_outcome_estimator,
    place_scores_on_last_token,
)
from fleetrl.algo.kl import (
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    KLController,
    kl_estimate,
    make_kl_controller,
)
from fleetrl.algo.losses import (
    AGGREGATIONS,
    POLICY_LOSSES,
    aggregate,
    apply_kl_penalty,
    entropy_from_logits,
    entropy_loss,
    kl_loss,
    ppo_policy_loss,
    value_loss,
    vanilla_pg_loss,
)
from fleetrl.algo.registry import Registry
from fleetrl.algo.stats import masked_mean, masked_sum, masked_var, masked_whiten

__all__ = [
    "ADVANTAGES",
    "AGGREGATIONS",
    "KL_CONTROLLERS",
    "KL_ESTIMATORS",
    "OUTCOME_ESTIMATORS",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "AdvantageInputs",
    "FixedKLController",
    "KLController",
    "Registry",
    "aggregate",
    "apply_kl_penalty",
    "discounted_returns",
    "entropy_from_logits",
    "entropy_loss",
    "fold_kl_into_scores",
    "gae_advantages",
    "group_stats",
    "is_outcome_estimator",
    "kl_estimate",
    "kl_loss",
    "make_kl_controller",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "place_scores_on_last_token",
    "ppo_policy_loss",
    "value_loss",
    "vanilla_pg_loss",
]
