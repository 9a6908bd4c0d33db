"""Rollout-trainer mismatch correction: importance weights pi_old / pi_rollout for the policy loss.

The rollout engine (vLLM, SGLang, our fast engine) and the trainer compute log-probs with different kernels,
precisions and batch shapes, so even with identical weights pi_rollout != pi_old, and the "on-policy" update
is silently off-policy. Yao et al. 2025 ("Your Efficient RL Framework Secretly Brings You Off-Policy RL
Training") show this can make training collapse and correct it with an importance weight
w = pi_old(y_t) / pi_rollout(y_t) on each token's loss. Modes (ROLLOUT_CORRECTIONS):

  none    weights 1; the ratio statistics are still reported, to watch the mismatch
  tis     truncated IS (Yao et al. 2025): w' = min(w, cap)
  mis     masked IS: w' = w where w <= cap, else 0 (the token, or at sequence level the whole sequence, is
          dropped instead of down-weighted)
  icepop  IcePop (Ling team, blog "Small Leak Can Sink a Great Ship: Boost RL Training on MoE with IcePop!"
          2025, used for Ring-1T, arXiv 2510.18855): w' = w where low <= w <= high, else 0 (double-sided
          masking; the blog uses low=0.5, high=5)

Levels: "token" uses each token's own ratio; "sequence" uses the product over the sequence's response tokens,
w_b = exp(sum_t (old_logp - rollout_logp)), broadcast to its tokens (truncating / masking whole sequences).
The weights are constants for the update: pass them as `is_weights_BT` to any POLICY_LOSSES entry.

The same weights are the off-policy correction of asynchronous training (trainer.mode=async, docs/async.md):
there pi_rollout is the behaviour policy of an older weights version and pi_old the current one (decoupled PPO,
Fu et al. 2025, AReaL), so staleness and kernel mismatch are corrected together. pi_old comes from the recompute
pass, or with one optimiser step per batch from the update's own forward: the actor loss then calls this per
micro-batch (workers/actor.py), which equals the whole batch's call since a sequence is never split.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from fleetrl.algo.registry import Registry
from fleetrl.algo.stats import masked_mean

# A sequence's summed log-ratio can be large; clamped before exp so the weight stays finite (e^20 = 4.9e8 is
# still far above any cap, so truncation and masking decide exactly as without the clamp).
_LOG_RATIO_CLAMP = 20.0


# (ratio_BT, cap, low, high) -> (weights_BT, clipped_BT, masked_BT): the weights, and which tokens were
# truncated or zeroed. Each mode reads only the bounds it uses. Masked positions are arbitrary; the caller masks.
CorrectionFn = Callable[[Tensor, float, float, float], tuple[Tensor, Tensor, Tensor]]
ROLLOUT_CORRECTIONS: Registry[CorrectionFn] = Registry("rollout correction mode")
LEVELS = ("token", "sequence")


def _nothing_BT(x_BT: Tensor) -> Tensor:
    return torch.zeros_like(x_BT, dtype=torch.bool)


@ROLLOUT_CORRECTIONS.register("none")
def _none(ratio_BT: Tensor, cap: float, low: float, high: float) -> tuple[Tensor, Tensor, Tensor]:
    return torch.ones_like(ratio_BT), _nothing_BT(ratio_BT), _nothing_BT(ratio_BT)


@ROLLOUT_CORRECTIONS.register("tis")
def _tis(ratio_BT: Tensor, cap: float, low: float, high: float) -> tuple[Tensor, Tensor, Tensor]:
    return ratio_BT.clamp(max=cap), ratio_BT > cap, _nothing_BT(ratio_BT)


@ROLLOUT_CORRECTIONS.register("mis")
def _mis(ratio_BT: Tensor, cap: float, low: float, high: float) -> tuple[Tensor, Tensor, Tensor]:
    masked_BT = ratio_BT > cap
    return torch.where(masked_BT, torch.zeros_like(ratio_BT), ratio_BT), _nothing_BT(ratio_BT), masked_BT


@ROLLOUT_CORRECTIONS.register("icepop")
def _icepop(ratio_BT: Tensor, cap: float, low: float, high: float) -> tuple[Tensor, Tensor, Tensor]:
    masked_BT = (ratio_BT < low) | (ratio_BT > high)
    return torch.where(masked_BT, torch.zeros_like(ratio_BT), ratio_BT), _nothing_BT(ratio_BT), masked_BT


def check_correction(mode: str, level: str = "token", cap: float = 2.0, low: float = 0.5, high: float = 5.0) -> None:
    """ValueError naming the algorithm.rollout_correction field when mode, level or bounds cannot work.

    Cheap and tensor-free: the config layer can call it once at load.
    """
    ROLLOUT_CORRECTIONS.get(mode)
    if level not in LEVELS:
        raise ValueError(f"algorithm.rollout_correction.level must be one of {list(LEVELS)}; got {level!r}")
    if mode in ("tis", "mis") and not cap > 0:
        raise ValueError(f"algorithm.rollout_correction.cap must be > 0 for mode {mode!r}; got {cap} "
                         "(Yao et al. 2025 use 2)")
    if mode == "icepop" and not 0 <= low < 1 < high:
        raise ValueError(f"algorithm.rollout_correction needs 0 <= low < 1 < high for mode 'icepop'; got "
                         f"low={low}, high={high} (IcePop uses low=0.5, high=5)")


@torch.no_grad()
def rollout_correction(
    old_logp_BT: Tensor, rollout_logp_BT: Tensor, mask_BT: Tensor, *,
    mode: str = "none", level: str = "token", cap: float = 2.0, low: float = 0.5, high: float = 5.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Importance weights [B, T] (0 where mask_BT is 0) and their statistics, for `is_weights_BT`.

    old_logp_BT: trainer log-probs of the sampled tokens under the proximal policy (the old-logprob pass, or the
    update's own forward, detached); rollout_logp_BT: the engine's log-probs of the same tokens; mask_BT: response mask. All [B, T].
    cap bounds tis / mis; [low, high] is the band icepop keeps.
    Metrics (detached scalars over valid tokens; a sequence-level ratio counts once per token of its sequence):
      rollout_is/ratio_mean, ratio_max, ratio_min   the raw ratio w at the chosen level, before correction
      rollout_is/weight_mean                        the corrected weights w'
      rollout_is/clipped_frac                       tokens whose weight was truncated (tis)
      rollout_is/masked_frac                        tokens whose weight was zeroed (mis, icepop)
    """
    check_correction(mode, level, cap, low, high)
    valid_BT = mask_BT.bool()
    log_ratio_BT = torch.where(valid_BT, old_logp_BT - rollout_logp_BT, torch.zeros_like(old_logp_BT))
    if level == "sequence":
        log_ratio_BT = log_ratio_BT.sum(dim=1, keepdim=True).expand_as(log_ratio_BT)
    ratio_BT = torch.exp(log_ratio_BT.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
    weights_BT, clipped_BT, masked_BT = ROLLOUT_CORRECTIONS.get(mode)(ratio_BT, cap, low, high)
    weights_BT = torch.where(valid_BT, weights_BT, torch.zeros_like(weights_BT))
    return weights_BT, _metrics(ratio_BT, weights_BT, clipped_BT, masked_BT, valid_BT)


def _metrics(ratio_BT: Tensor, weights_BT: Tensor, clipped_BT: Tensor, masked_BT: Tensor,
             valid_BT: Tensor) -> dict[str, Tensor]:
    # On the device, with no host read: a `bool(...)` or a boolean index here made every micro-batch of the
    # update wait for its forward to finish before its backward could be queued (bench/RESULTS.md, "GPU speed,
    # eleventh round").
    one = ratio_BT.new_ones(())  # the placeholder when no token is valid
    ratio_max = ratio_min = one
    if ratio_BT.numel():  # amax / amin of an empty tensor raise
        any_valid = valid_BT.any()
        ratio_max = torch.where(any_valid, torch.where(valid_BT, ratio_BT, -torch.inf).amax(), one)
        ratio_min = torch.where(any_valid, torch.where(valid_BT, ratio_BT, torch.inf).amin(), one)
    return {
        "rollout_is/ratio_mean": masked_mean(ratio_BT, valid_BT),
        "rollout_is/ratio_max": ratio_max,
        "rollout_is/ratio_min": ratio_min,
        "rollout_is/weight_mean": masked_mean(weights_BT, valid_BT),
        "rollout_is/clipped_frac": masked_mean(clipped_BT.float(), valid_BT),
        "rollout_is/masked_frac": masked_mean(masked_BT.float(), valid_BT),
    }
