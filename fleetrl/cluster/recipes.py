"""Launcher recipes: an sbatch script (`fleetrl slurm`) and a dstack task (`fleetrl dstack`) for a run.

Both start Ray with `fleetrl cluster up` on every node, role taken from the launcher's variables (node 0
is the head), then train on the head. Workers run `cluster up --block`, which returns once the head has
gone away, so the launcher's step ends when training does.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

import yaml

from fleetrl.cluster.netenv import PROFILES
from fleetrl.config.plan import PoolPlan

FLEETRL = "python -m fleetrl.cli.main"  # works from a checkout without the console script installed


@dataclass(frozen=True, kw_only=True, slots=True)
class Recipe:
    config: str
    nodes: int
    gpus_per_node: int = 8
    overrides: tuple[str, ...] = ()
    port: int = 6379
    net_profile: str | None = None
    container: str | None = None
    time: str = "24:00:00"
    name: str | None = None

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ValueError(f"--nodes {self.nodes}: a cluster needs at least one node")
        if self.gpus_per_node < 0:
            raise ValueError(f"--gpus-per-node {self.gpus_per_node} must be >= 0")
        if self.net_profile is not None and self.net_profile not in PROFILES:
            raise ValueError(f"--net-profile {self.net_profile!r}: choose one of {sorted(PROFILES)}")

    @property
    def job_name(self) -> str:
        return self.name or f"fleetrl-{Path(self.config).stem}"


def check_config(r: Recipe) -> None:
    """Loads the run config with its overrides and derives its plan, as `fleetrl train` will on the head: a typo
    fails here, not after the job has waited in the cluster's queue. The path is read from this directory, which
    is also where the job runs (sbatch's submit dir; the working dir dstack uploads)."""
    from fleetrl.config import check_plan, load_config  # config only when a recipe is printed
    from fleetrl.envs.check import check_env_config

    # Secrets (${env:..}, ${file:..}) stay unresolved: they live on the head or in its job environment, not here.
    plan = check_plan(load_config(r.config, list(r.overrides), resolve=False))
    check_env_config(plan.config.rollout.env)
    check_gpus_fit(list(plan.pools.values()), r.nodes, r.gpus_per_node)


def check_gpus_fit(pools: list[PoolPlan], nodes: int, gpus_per_node: int) -> None:
    """The pools' GPUs on `nodes` nodes of `gpus_per_node` GPUs, first fit, each node of a pool a distinct node
    (as placement packs them): a plan that cannot fit would otherwise wait in the queue, then in placement. Only
    GPUs are known here; a node's CPUs and memory are the scheduler's to say."""
    free = [float(gpus_per_node)] * nodes
    for pool in sorted(pools, key=lambda p: -_gpus_per_node(p)):
        need, placed = _gpus_per_node(pool), 0
        for i in range(nodes):
            if placed == pool.nodes or need == 0:
                break
            if free[i] + 1e-9 >= need:
                free[i] -= need
                placed += 1
        if need and placed < pool.nodes:
            raise ValueError(f"pool '{pool.name}' asks for {pool.nodes} node(s) with {need:g} GPU(s) each, but --nodes "
                             f"{nodes} x --gpus-per-node {gpus_per_node} leaves room for {placed} (other pools "
                             f"placed first); raise --nodes or --gpus-per-node, or lower cluster.pools.{pool.name}."
                             f"nodes / workers_per_node / gpus_per_worker")


def _gpus_per_node(pool: PoolPlan) -> float:
    return pool.bundle.get("GPU", 0.0) * pool.bundles_per_node


def slurm_script(r: Recipe) -> str:
    """An sbatch script: one srun task per node runs the node script below, which branches on SLURM_NODEID."""
    gpus = f"#SBATCH --gpus-per-node={r.gpus_per_node}\n" if r.gpus_per_node else ""
    container = (f" --container-image={shlex.quote(r.container)}"
                 f' --container-mounts="$HOME:$HOME,$PWD:$PWD" --container-workdir="$PWD"') if r.container else ""
    state = '"/tmp/fleetrl-cluster-$SLURM_JOB_ID.json"'  # node-local: each node records its own Ray
    node_script = "\n".join([
        "set -euo pipefail",
        f"up=({FLEETRL} cluster up --port {r.port} --token-file \"$FLEETRL_TOKEN_FILE\" --state-file {state}"
        f"{_profile(r)})",
        'if [ "$SLURM_NODEID" = 0 ]; then',
        f'  "${{up[@]}}" --expect-nodes {r.nodes} --wait-timeout 900',
        f"  trap '{FLEETRL} cluster down --state-file {state}' EXIT",
        f"  {_train(r)}",
        "else",
        '  "${up[@]}" --block',
        "fi",
    ])
    command = shlex.join(["fleetrl", "slurm", r.config, *r.overrides, "--nodes", str(r.nodes),
                          "--gpus-per-node", str(r.gpus_per_node)])
    return f"""#!/bin/bash
#SBATCH --job-name={r.job_name}
#SBATCH --nodes={r.nodes}
#SBATCH --ntasks-per-node=1
{gpus}#SBATCH --exclusive
#SBATCH --time={r.time}
#SBATCH --output={r.job_name}-%j.out
# Generated by `{command}`.
# Ray on every node via `fleetrl cluster up` (node 0 of SLURM_JOB_NODELIST is the head), training on the head.
set -euo pipefail

# The cluster's auth token, written before any node starts so no worker races the head for it. It must
# be on a filesystem all nodes share ($HOME here); it is never printed.
export FLEETRL_TOKEN_FILE="$HOME/.fleetrl/tokens/slurm-$SLURM_JOB_ID"
mkdir -p "$(dirname "$FLEETRL_TOKEN_FILE")"
(umask 077 && python3 -c 'import secrets; print(secrets.token_hex(32))' > "$FLEETRL_TOKEN_FILE")
trap 'rm -f "$FLEETRL_TOKEN_FILE"' EXIT

NODE_SCRIPT=$(cat <<'FLEETRL_NODE_SCRIPT'
{node_script}
FLEETRL_NODE_SCRIPT
)
srun --nodes={r.nodes} --ntasks-per-node=1 --kill-on-bad-exit=1{container} bash -c "$NODE_SCRIPT"
"""


def dstack_task(r: Recipe) -> str:
    """A dstack task YAML; dstack runs the same commands on every node with DSTACK_NODE_RANK set."""
    node_script = "\n".join([  # POSIX sh: dstack does not promise bash
        f"up='{FLEETRL} cluster up --port {r.port}{_profile(r)}'",
        'if [ "$DSTACK_NODE_RANK" = 0 ]; then',
        f"  $up --expect-nodes {r.nodes} --wait-timeout 900",
        f"  {_train(r)}",
        "else",
        "  $up --block",
        "fi",
    ]) + "\n"
    task: dict = {"type": "task", "name": r.job_name, "nodes": r.nodes}
    task.update({"image": r.container} if r.container else {"python": "3.11"})
    # No value: dstack takes RAY_AUTH_TOKEN from the environment of `dstack apply`, so every node gets the
    # same token and none is written into this file.
    task["env"] = ["RAY_AUTH_TOKEN"]
    task["commands"] = ["pip install -e .", node_script]
    task["resources"] = {"shm_size": "16GB", **({"gpu": r.gpus_per_node} if r.gpus_per_node else {})}
    header = ("# Generated by `fleetrl dstack`. Before `dstack apply -f THIS_FILE`:\n"
              "#   export RAY_AUTH_TOKEN=$(python -c 'import secrets; print(secrets.token_hex(32))')\n")
    return header + yaml.dump(task, Dumper=_LiteralDumper, sort_keys=False)


def _train(r: Recipe) -> str:
    return shlex.join([*FLEETRL.split(), "train", r.config, *r.overrides])


def _profile(r: Recipe) -> str:
    return f" --net-profile {r.net_profile}" if r.net_profile else ""  # validated: a plain word


class _LiteralDumper(yaml.SafeDumper):
    """Writes multi-line strings as `|` blocks so the node script stays readable."""


def _literal(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_LiteralDumper.add_representer(str, _literal)

