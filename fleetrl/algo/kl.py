"""Per-token KL estimators between the policy and a reference, and the KL-coefficient controllers.

Estimators follow Schulman's "Approximating KL Divergence" (2020) notes: with tokens sampled from the
policy and log r = ref_logp - logp,
  k1 = -log r                unbiased, high variance, can be negative per token
  k2 = 0.5 * (log r)^2       biased, low variance, always >= 0
  k3 = (r - 1) - log r       unbiased, low variance, always >= 0

k3 grows like e^|log r| when the policy puts far less mass on a token than the reference (log r >> 0): at
logp - ref_logp = -5 it is 142 with gradient -147, at -20 it is 4.9e8, so one such token would dominate the KL
term of a whole batch. It is therefore clamped to at most K3_MAX = 10, the bound verl (`core_algos.kl_penalty`,
"low_var_kl") and OpenRLHF (`models/utils.compute_approx_kl`, "k3") both use; beyond it the token contributes
a constant 10 and no gradient.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor

from fleetrl.algo.registry import Registry

KLEstimator = Callable[[Tensor, Tensor], Tensor]
KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator")

# exp() of a log-ratio above ~88 overflows float32; tokens that far apart carry no useful signal anyway.
_LOG_RATIO_CLAMP = 20.0
K3_MAX = 10.0  # upper bound of the k3 estimate (see the module docstring for where it comes from)


@KL_ESTIMATORS.register("k1")
def k1(logp_BT: Tensor, ref_logp_BT: Tensor) -> Tensor:
    """[B, T] logp - ref_logp."""
    return logp_BT - ref_logp_BT


@KL_ESTIMATORS.register("k2")
def k2(logp_BT: Tensor, ref_logp_BT: Tensor) -> Tensor:
    """[B, T] 0.5 * (logp - ref_logp)^2."""
    return 0.5 * (logp_BT - ref_logp_BT) ** 2


@KL_ESTIMATORS.register("k3")
def k3(logp_BT: Tensor, ref_logp_BT: Tensor) -> Tensor:
    """[B, T] exp(ref - logp) - (ref - logp) - 1, clamped to at most K3_MAX; log-ratio clamped to [-20, 20] first.

    The clamp bounds both the value and the gradient of tokens the policy has moved far below the reference.
    """
    log_r_BT = (ref_logp_BT - logp_BT).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return (torch.exp(log_r_BT) - log_r_BT - 1).clamp(max=K3_MAX)


def kl_estimate(logp_BT: Tensor, ref_logp_BT: Tensor, kind: str) -> Tensor:
    """[B, T] per-token estimate of KL(policy || ref) with estimator `kind` in KL_ESTIMATORS.

    logp_BT, ref_logp_BT: [B, T] log-probs of the sampled tokens under the policy and the reference.
    Not masked: callers mask or aggregate.
    """
    return KL_ESTIMATORS.get(kind)(logp_BT, ref_logp_BT)


# ----------------------------------------------------------------------------------------- controllers
class KLController(Protocol):
    coef: float

    def update(self, current_kl: float, n_steps: int) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, d: dict[str, Any]) -> None: ...


class FixedKLController:
    """Constant KL coefficient; `update` is a no-op so the trainer treats both controllers alike."""

    def __init__(self, coef: float) -> None:
        self.coef = float(coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"coef": self.coef}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.coef = float(d["coef"])


class AdaptiveKLController:
    """Ziegler et al. 2019: steer the coefficient so the observed KL tracks `target`.

    err = clip(current_kl / target - 1, -0.2, 0.2);  coef *= 1 + err * n_steps / horizon.
    The clip bounds how far one noisy KL measurement can move the coefficient. At the cap, `horizon`
    steps' worth of updates multiply coef by about e^0.2.
    """

    def __init__(self, init_coef: float, target: float, horizon: float) -> None:
        if target <= 0 or horizon <= 0:
            raise ValueError(
                f"adaptive KL controller needs target > 0 and horizon > 0; got target={target}, "
                f"horizon={horizon}"
            )
        self.coef = float(init_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        err = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.coef *= 1.0 + err * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"coef": self.coef, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.coef = float(d["coef"])
        self.target = float(d.get("target", self.target))
        self.horizon = float(d.get("horizon", self.horizon))


KLControllerFactory = Callable[[float, float | None, float | None], KLController]
KL_CONTROLLERS: Registry[KLControllerFactory] = Registry("KL controller")


@KL_CONTROLLERS.register("fixed")
def _fixed(coef: float, target: float | None, horizon: float | None) -> KLController:
    return FixedKLController(coef)


@KL_CONTROLLERS.register("adaptive")
def _adaptive(coef: float, target: float | None, horizon: float | None) -> KLController:
    if target is None or horizon is None:
        raise ValueError(
            f"KL controller 'adaptive' needs target and horizon; got target={target}, horizon={horizon} "
            "(set both, or use kind 'fixed')"
        )
    return AdaptiveKLController(coef, target, horizon)


def make_kl_controller(
    kind: str, coef: float, target: float | None = None, horizon: float | None = None
) -> KLController:
    """A controller of `kind` in {"fixed", "adaptive"}; adaptive needs target and horizon."""
    return KL_CONTROLLERS.get(kind)(coef, target, horizon)
