"""Worker environment: user variables plus a check of conflicting device-visibility variables.

Ray sets CUDA_VISIBLE_DEVICES per actor; a ROCR_VISIBLE_DEVICES or HIP_VISIBLE_DEVICES inherited from a
scheduler then disagrees with it and recent torch/ROCm builds refuse to start (a known failure of Ray-based RL
stacks on AMD and mixed clusters). We drop the inherited AMD variables on NVIDIA nodes, and report a conflict
the user set explicitly, rather than letting the worker die at CUDA init.
"""
from __future__ import annotations

import logging
import os
from typing import Mapping

from fleetrl.errors import UserError

log = logging.getLogger("fleetrl.cluster")
_AMD = ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")


class EnvConflictError(UserError, ValueError):
    pass


def resolve_device_env(user_env: Mapping[str, str], host_env: Mapping[str, str] | None = None) -> dict[str, str]:
    host = os.environ if host_env is None else host_env
    env = dict(user_env)
    explicit = [k for k in _AMD if k in env]
    if explicit and "CUDA_VISIBLE_DEVICES" in env and any(env[k] != env["CUDA_VISIBLE_DEVICES"] for k in explicit):
        raise EnvConflictError(
            f"cluster.env sets CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']!r} and "
            + ", ".join(f"{k}={env[k]!r}" for k in explicit)
            + "; they select different devices. Keep one (Ray assigns CUDA_VISIBLE_DEVICES per worker, so "
              "usually remove both from cluster.env)")
    inherited = [k for k in _AMD if k in host and k not in env]
    if inherited:
        # A runtime env can set variables but not remove inherited ones, so the worker removes the names listed
        # in FLEETRL_UNSET_ENV first thing (workers/worker.py), on NVIDIA builds of torch only.
        log.warning("workers will drop inherited %s: Ray assigns devices through CUDA_VISIBLE_DEVICES",
                    ", ".join(inherited))
        env["FLEETRL_UNSET_ENV"] = ",".join(inherited)
    return env
