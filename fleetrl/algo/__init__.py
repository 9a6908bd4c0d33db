"""Algorithm math of fleetrl: advantage estimators, policy/critic/KL/entropy losses, KL control, rollout-
mismatch correction and DAPO's batch shaping.

Pure torch functions on padded [B, T] tensors, chosen by name from registries at config load:
    ADVANTAGES.get("grpo"), POLICY_LOSSES.get("ppo"), AGGREGATIONS.get("token-mean"), KL_ESTIMATORS.get("k3"),
    ROLLOUT_CORRECTIONS.get("tis").
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
from fleetrl.algo.correction import (
    ROLLOUT_CORRECTIONS,
    check_correction,
    rollout_correction,
)
from fleetrl.algo.dapo import (
    groups_with_varied_scores,
    mask_truncated,
    overlong_penalty,
)
from fleetrl.algo.kl import (
    K3_MAX,
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
    cispo_policy_loss,
    entropy_from_logits,
    entropy_loss,
    gspo_policy_loss,
    kl_loss,
    ppo_policy_loss,
    value_loss,
    vanilla_pg_loss,
)
from fleetrl.algo.registry import Registry
from fleetrl.algo.stats import masked_mean, masked_sum, masked_var, masked_whiten

__all__ = [
    "ADVANTAGES", "AGGREGATIONS", "K3_MAX", "KL_CONTROLLERS", "KL_ESTIMATORS", "OUTCOME_ESTIMATORS",
    "POLICY_LOSSES", "ROLLOUT_CORRECTIONS",
    "AdaptiveKLController", "AdvantageInputs", "FixedKLController", "KLController", "Registry",
    "aggregate", "apply_kl_penalty", "check_correction", "cispo_policy_loss", "discounted_returns",
    "entropy_from_logits", "entropy_loss", "fold_kl_into_scores", "gae_advantages", "group_stats",
    "groups_with_varied_scores", "gspo_policy_loss", "is_outcome_estimator", "kl_estimate", "kl_loss",
    "make_kl_controller", "mask_truncated", "masked_mean", "masked_sum", "masked_var", "masked_whiten",
    "overlong_penalty", "place_scores_on_last_token", "ppo_policy_loss", "rollout_correction", "value_loss",
    "vanilla_pg_loss",
]
