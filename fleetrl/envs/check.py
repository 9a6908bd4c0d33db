"""rollout.env's name, file and kwargs, checked where a run is assembled or prepared, not by config/: config knows
no environments (its checks cover rollout.env's numbers and the keys it conflicts with).

Callers, each before anything is created: trainer/run.py:plan_for (`fleetrl train`, `config show`), a sweep's grid
points (sweep/validate.py), `fleetrl submit` (cli/ops.py) and the slurm/dstack recipes (cluster/recipes.py).
"""
from __future__ import annotations

from fleetrl.config.load import ConfigError
from fleetrl.config.schema import EnvConfig
from fleetrl.envs.base import EnvError, env_factory


def check_env_config(env: EnvConfig | None) -> None:
    """One instance is built (env_factory does), so a bad name, file or keyword is one ConfigError before Ray
    starts or a run directory exists. None (no rollout.env) passes."""
    if env is None:
        return
    try:
        env_factory(env.name, **env.kwargs)
    except EnvError as e:
        raise ConfigError(f"rollout.env.name / rollout.env.kwargs: {e}") from None
