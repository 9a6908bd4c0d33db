"""Connecting the driver to Ray: start a local cluster when the config names none, or join one."""
from __future__ import annotations

import logging
import os
import subprocess

import ray

from fleetrl.cluster import auth, reaper
from fleetrl.config.schema import ClusterConfig

log = logging.getLogger("fleetrl.cluster")


def ensure_ray(cfg: ClusterConfig) -> bool:
    """Returns True when this call started Ray (so the caller should shut it down)."""
    if cfg.backend == "local" or ray.is_initialized():
        return False
    # Workers inherit the driver's env unless told otherwise; pin their threads so a 2-core machine with several
    # workers does not oversubscribe (users override through cluster.env).
    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **cfg.env}
    kwargs = {"include_dashboard": False, "log_to_driver": True, "runtime_env": {"env_vars": env},
              "configure_logging": True, "logging_level": logging.WARNING}
    if cfg.address is None:
        # A sweep runs several local clusters side by side: each gets its own temp dir (sockets, logs,
        # session files) and namespace; Ray picks free ports for GCS, raylet and workers.
        kwargs.update(_isolation_from_env())
        # address="local" so a stale cluster file from another run can't make us join the wrong cluster.
        ray.init(address="local", num_cpus=cfg.num_cpus or os.cpu_count(), **kwargs)
        start_reaper()
        log.info("started a local Ray cluster")
    else:
        kwargs.pop("include_dashboard")
        use_cluster_token(cfg.address)
        ray.init(address=cfg.address, **kwargs)
        log.info("joined Ray cluster at %s", cfg.address)
    return True


def use_cluster_token(address: str) -> None:
    """Checks this driver's token with the head before ray.init: a missing or wrong one is one line within seconds
    (TokenRejectedError) instead of Ray's 95-line ConnectionError after 26 s. Ray sends no token to an explicit
    address unless RAY_AUTH_MODE=token, even one it would find; when the head wants a token and the mode is not set,
    it is set here to the token found (as `fleetrl cluster up` does for its nodes)."""
    if address.startswith("ray://") or ":" not in address or os.environ.get(auth.MODE_ENV, "").lower() == "disabled":
        return  # Ray Client, "auto", or auth turned off on purpose: Ray's own connection decides
    token = auth.find_token_or_none(os.environ)
    if auth.check_token(address, token) and auth.MODE_ENV not in os.environ:
        auth.apply_token_env(os.environ, token)
        auth.reload_ray_auth()


def start_reaper() -> None:
    """Starts the reaper (cluster/reaper.py) of the local Ray this process just started: were this driver killed,
    the raylet's agents would outlive it. A reaper that cannot start costs a warning, never the run."""
    node = ray._private.worker._global_node  # noqa: SLF001 — the processes ray.init started, with their PIDs
    started = [(p.process.pid, reaper.start_ticks(p.process.pid)) for infos in node.all_processes.values()
               for p in infos]
    known = {pid: ticks for pid, ticks in started if ticks is not None}
    raylet = node.all_processes["raylet"][0].process.pid
    me = os.getpid()
    my_ticks = reaper.start_ticks(me)
    if raylet not in known or my_ticks is None:
        log.warning("no reaper for the local Ray: its raylet (pid %s) already exited", raylet)
        return
    cmd = reaper.command((me, my_ticks), (raylet, known[raylet]),
                         ray.get_runtime_context().get_node_id(), list(known.items()))
    try:  # returns at once: the reaper detaches (forks) and its first process exits
        subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       timeout=30, check=True)
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("could not start the reaper of the local Ray (%s); if this driver is killed, its Ray's "
                    "DashboardAgent and RuntimeEnvAgent may outlive it", e)


def _isolation_from_env() -> dict:
    """`fleetrl sweep` sets FLEETRL_RAY_TMPDIR / FLEETRL_RAY_NAMESPACE per run (the temp dir is kept short:
    Unix socket paths inside it are limited to 107 bytes)."""
    out: dict = {}
    if os.environ.get("FLEETRL_RAY_TMPDIR"):
        out["_temp_dir"] = os.environ["FLEETRL_RAY_TMPDIR"]
    if os.environ.get("FLEETRL_RAY_NAMESPACE"):
        out["namespace"] = os.environ["FLEETRL_RAY_NAMESPACE"]
    return out
