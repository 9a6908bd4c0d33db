"""Cluster-operation commands: `cluster up|status|down`, `doctor`, `submit`, `jobs ...`, `slurm`, `dstack`,
`serve-reward`. Each command parses its flags and calls the library; `register(app)` adds them to an app."""
from __future__ import annotations

import os
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from fleetrl.cli.errors import user_errors

console = Console()
err_console = Console(stderr=True)

# Operations fail on the user's machines and networks: these are theirs to fix from the message too.
_user_errors = user_errors(ValueError, RuntimeError, TimeoutError, ConnectionError, FileNotFoundError)

Address = typer.Option(..., "--address", help="Job API of the head: http://HEAD_IP:8265.")
TokenFile = typer.Option(None, "--token-file", help="Cluster auth token file (default: RAY_AUTH_TOKEN, "
                                                    "RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token).")
StateFile = typer.Option(None, "--state-file", help="Where `cluster up` records what it started "
                                                    "(default ~/.fleetrl/cluster-HOSTNAME.json).")


def _token(token_file: Optional[Path]):
    from fleetrl.cluster.auth import find_token, find_token_or_none

    return find_token(os.environ, token_file) if token_file else find_token_or_none(os.environ)


# ------------------------------------------------------------------------------------------------ cluster
@_user_errors
def cluster_up(
    head: bool = typer.Option(False, "--head", help="This node is the head (overrides launcher variables)."),
    address: Optional[str] = typer.Option(None, "--address", help="Join the head at HOST:PORT."),
    port: int = typer.Option(6379, "--port", help="Ray GCS port of the head."),
    node_ip: Optional[str] = typer.Option(None, "--node-ip-address", help="This node's IP (default: detected)."),
    expect_nodes: int = typer.Option(1, "--expect-nodes", help="Head: wait until this many nodes are alive."),
    wait_timeout: float = typer.Option(600.0, "--wait-timeout", help="Head: seconds to wait for the nodes."),
    join_timeout: float = typer.Option(600.0, "--join-timeout", help="Worker: seconds to wait for the head."),
    token_file: Optional[Path] = TokenFile,
    net_profile: Optional[str] = typer.Option(None, "--net-profile", help="Network env: ib, ethernet, single-node."),
    env: Optional[List[str]] = typer.Option(None, "--env", help="KEY=VALUE for every Ray worker on this node."),
    dashboard_host: str = typer.Option("127.0.0.1", "--dashboard-host", help="Dashboard/job API bind address."),
    dashboard_port: int = typer.Option(8265, "--dashboard-port"),
    num_cpus: Optional[int] = typer.Option(None, "--num-cpus"),
    num_gpus: Optional[int] = typer.Option(None, "--num-gpus"),
    object_store_memory: Optional[int] = typer.Option(None, "--object-store-memory", help="Bytes."),
    temp_dir: Optional[Path] = typer.Option(None, "--temp-dir", help="Ray's temp dir on this node."),
    state_file: Optional[Path] = StateFile,
    ray_arg: Optional[List[str]] = typer.Option(None, "--ray-arg", help="Extra `ray start` argument, e.g. "
                                                "--ray-arg=--dashboard-agent-listen-port=52366."),
    block: bool = typer.Option(False, "--block", help="Stay in the foreground until Ray (or the head) stops."),
) -> None:
    """Start Ray on this node as head or worker (role from flags, SLURM, dstack or torchrun variables)."""
    from fleetrl.cluster.up import UpOptions, block_until_exit
    from fleetrl.cluster.up import cluster_up as up

    up(UpOptions(head=head, address=address, port=port, node_ip=node_ip, expect_nodes=expect_nodes,
                 wait_timeout_s=wait_timeout, join_timeout_s=join_timeout, token_file=token_file,
                 net_profile=net_profile, env=tuple(env or ()), dashboard_host=dashboard_host,
                 dashboard_port=dashboard_port, num_cpus=num_cpus, num_gpus=num_gpus,
                 object_store_memory=object_store_memory, temp_dir=temp_dir, state_file=state_file,
                 ray_args=tuple(ray_arg or ())),
       console=err_console)
    if block:
        raise typer.Exit(block_until_exit(state_file))


@_user_errors
def cluster_status(state_file: Optional[Path] = StateFile) -> None:
    """Show what `cluster up` started on this node and the cluster's nodes."""
    from fleetrl.cluster.up import cluster_status as status

    s = status(state_file)
    if s.state is None:
        console.print("no Ray started by `fleetrl cluster up` on this node")
        raise typer.Exit(1)
    console.print(Text(f"{s.state.role} of {s.state.address} (pid {s.state.pid}, "
                       f"{'running' if s.running else 'NOT running'}); token {s.state.token_masked}; "
                       f"log {s.state.log_path}"))
    if s.error:
        console.print(Text(str(s.error), style="red"))
    if s.nodes:
        table = Table("node", "alive", "CPU", "GPU", "memory GB")
        for n in s.nodes:
            r = n["Resources"]
            table.add_row(n["NodeManagerAddress"], "✓" if n["Alive"] else "✗", f"{r.get('CPU', 0):g}",
                          f"{r.get('GPU', 0):g}", f"{r.get('memory', 0) / 2**30:.1f}")
        console.print(table)
    if not s.running:
        raise typer.Exit(1)


@_user_errors
def cluster_down(state_file: Optional[Path] = StateFile) -> None:
    """Stop only the Ray processes `cluster up` started on this node (by PID; never `ray stop`)."""
    from fleetrl.cluster.up import cluster_down as down

    stopped = down(state_file)
    console.print(f"stopped {stopped.role} (pid {stopped.pid})" if stopped else "nothing to stop")


# ------------------------------------------------------------------------------------------------- doctor
@_user_errors
def doctor(
    config: Optional[Path] = typer.Argument(None, help="Run config: checks its placement against the cluster."),
    address: Optional[str] = typer.Option(None, "--address", help="GCS address HOST:PORT (default: this node's "
                                                                  "`cluster up` state, then cluster.address, "
                                                                  "else this machine through a local Ray)."),
    checkpoint_path: Optional[Path] = typer.Option(None, "--checkpoint-path", help="Default: trainer.output_dir "
                                                                                   "or ./runs."),
    token_file: Optional[Path] = TokenFile,
    state_file: Optional[Path] = StateFile,
    min_free_gb: Optional[float] = typer.Option(None, "--min-free-gb", help="Free GB each node needs at the "
                                                "checkpoint path (default: what the config's run writes, else 20)."),
    timeout: float = typer.Option(60.0, "--timeout", help="Seconds per probe / all-reduce."),
) -> None:
    """Check the cluster: versions, GPUs, env, placement, shared filesystem, ports, all-reduce, disk. With no
    cluster running, check this machine (through a local Ray, as `fleetrl train` starts one)."""
    from fleetrl.cluster.doctor import DoctorOptions, local_cpus, local_note, render, resolve_targets, run_doctor

    address, checkpoint_path, token_file = resolve_targets(config, address, checkpoint_path, state_file, token_file)
    if address is None:
        err_console.print(Text(local_note(local_cpus(config))), soft_wrap=True)
    results = run_doctor(DoctorOptions(address=address, checkpoint_path=checkpoint_path, config_path=config,
                                       min_free_gb=min_free_gb, timeout_s=timeout), _token(token_file))
    if not render(results, console):
        raise typer.Exit(1)


# --------------------------------------------------------------------------------------------------- jobs
@_user_errors
def submit(
    config: str = typer.Argument(..., help="Run config, relative to --working-dir."),
    overrides: Optional[List[str]] = typer.Argument(None, help="key=value overrides."),
    address: str = Address,
    working_dir: Path = typer.Option(Path("."), "--working-dir", help="Uploaded to the cluster (without outputs, "
                                                                      ".git, .env, token and key files)."),
    env: Optional[List[str]] = typer.Option(None, "--env", help="KEY=VALUE for the job, or KEY to pass this "
                                                                "shell's value (keeps it out of argv)."),
    token_file: Optional[Path] = TokenFile,
) -> None:
    """Submit `fleetrl train CONFIG overrides...` to the cluster as a Ray job; prints the job id. The job joins
    the cluster it is submitted to (cluster.address=auto) unless the config names an address. Without
    trainer.output_dir it writes to $HOME/fleetrl-runs/NAME-TIMESTAMP on the head (not inside Ray's working dir
    copy, which Ray may delete); set trainer.output_dir (a shared path for multi-node runs) to choose."""
    from fleetrl.cluster.jobs import env_from_args, secret_env_names, submission_spec, submit_spec
    from fleetrl.config import check_plan, load_config
    from fleetrl.envs.check import check_env_config

    # Checked here, as `fleetrl train` will check it on the head: a typo then costs a second, not an upload and a
    # failed job. Secrets (${env:..}, ${file:..}) stay unresolved: they may live only on the head.
    cfg = load_config(working_dir / config, list(overrides or []), resolve=False)
    check_plan(cfg)
    check_env_config(cfg.rollout.env)
    env_vars = env_from_args(env or [])
    secret = secret_env_names(env_vars)
    if secret:
        err_console.print(f"note: Ray keeps --env values ({', '.join(secret)}) in its job record for the cluster's "
                          f"lifetime; to keep a secret out of it, export it before `fleetrl cluster up` on the "
                          f"head or read it from a file with ${{file:PATH}} (docs/multinode.md)",
                          soft_wrap=True, highlight=False, markup=False)
    spec = submission_spec(config, list(overrides or []), working_dir=working_dir, env_vars=env_vars)
    job_id = submit_spec(address, spec, _token(token_file))
    if spec.output_dir is not None:  # on stderr, before the id: scripts read the job id as the last stdout line
        err_console.print(f"run directory on the head: {spec.output_dir} (trainer.output_dir unset; set it to "
                          f"write elsewhere, e.g. a shared filesystem)", soft_wrap=True, highlight=False,
                          markup=False)
    console.print(job_id)


@_user_errors
def jobs_list(address: str = Address, token_file: Optional[Path] = TokenFile) -> None:
    """List the cluster's jobs."""
    from rich.table import Column

    from fleetrl.cluster.jobs import list_jobs

    # The id is what users copy into `jobs status/logs/stop`: never wrapped or cut, whatever the terminal width
    # (the entrypoint and message columns fold instead).
    table = Table(Column("job", no_wrap=True, min_width=26), Column("status", no_wrap=True), "entrypoint", "message")
    for j in list_jobs(address, _token(token_file)):
        table.add_row(*(Text(str(v)) for v in (j.job_id, j.status, j.entrypoint, j.message)))
    console.print(table)


@_user_errors
def jobs_status(job_id: str, address: str = Address, token_file: Optional[Path] = TokenFile) -> None:
    """Show one job's status."""
    from fleetrl.cluster.jobs import job_status

    j = job_status(address, job_id, _token(token_file))
    console.print(Text(f"{j.job_id}: {j.status}  {j.message}\n  {j.entrypoint}"), highlight=False)


@_user_errors
def jobs_logs(job_id: str, address: str = Address, token_file: Optional[Path] = TokenFile,
              follow: bool = typer.Option(False, "--follow", "-f", help="Stream until the job ends.")) -> None:
    """Print a job's logs."""
    from fleetrl.cluster.jobs import job_logs

    logs = job_logs(address, job_id, _token(token_file), follow=follow)
    if not follow:
        typer.echo(logs, nl=False)


@_user_errors
def jobs_stop(job_id: str, address: str = Address, token_file: Optional[Path] = TokenFile) -> None:
    """Stop a running job."""
    from fleetrl.cluster.jobs import stop_job

    console.print("stopping" if stop_job(address, job_id, _token(token_file)) else "job had already ended")


# ---------------------------------------------------------------------------------------------- recipes
@_user_errors
def slurm(
    config: str = typer.Argument(...), overrides: Optional[List[str]] = typer.Argument(None),
    nodes: int = typer.Option(..., "--nodes"), gpus_per_node: int = typer.Option(8, "--gpus-per-node"),
    container: Optional[str] = typer.Option(None, "--container", help="Image for pyxis (srun --container-image)."),
    port: int = typer.Option(6379, "--port", min=1, max=65535),
    net_profile: Optional[str] = typer.Option("ib", "--net-profile"), time: str = typer.Option("24:00:00", "--time"),
) -> None:
    """Print an sbatch script: Ray on every node, training on the head."""
    from fleetrl.cluster.recipes import Recipe, check_config, slurm_script

    recipe = Recipe(config=config, nodes=nodes, gpus_per_node=gpus_per_node, overrides=tuple(overrides or ()),
                    port=port, net_profile=net_profile, container=container, time=time)
    check_config(recipe)  # before printing: a script that only fails on the cluster is worse than no script
    typer.echo(slurm_script(recipe), nl=False)


@_user_errors
def dstack(
    config: str = typer.Argument(...), overrides: Optional[List[str]] = typer.Argument(None),
    nodes: int = typer.Option(..., "--nodes"), gpus_per_node: int = typer.Option(8, "--gpus-per-node"),
    image: Optional[str] = typer.Option(None, "--image"), port: int = typer.Option(6379, "--port", min=1, max=65535),
    net_profile: Optional[str] = typer.Option("ethernet", "--net-profile"),
) -> None:
    """Print a dstack task YAML: Ray on every node, training on the node of rank 0."""
    from fleetrl.cluster.recipes import Recipe, check_config, dstack_task

    recipe = Recipe(config=config, nodes=nodes, gpus_per_node=gpus_per_node, overrides=tuple(overrides or ()),
                    port=port, net_profile=net_profile, container=image)
    check_config(recipe)  # before printing: a task that only fails on the cluster is worse than no task
    typer.echo(dstack_task(recipe), nl=False)


# ---------------------------------------------------------------------------------------------- rewards
@_user_errors
def serve_reward(
    fn: str = typer.Option("", "--fn", help="Scorer: path/to/file.py:fn or a builtin name."),
    model: Optional[str] = typer.Option(None, "--model", help="Serve a reward model instead of --fn: HF folder, hub "
                                        "id or tiny:; bodies then carry `prompts` (docs/reward_models.md)."),
    kind: str = typer.Option("scalar", "--kind", help="--model kind: scalar (sequence classifier) or judge."),
    max_length: int = typer.Option(1024, "--max-length", help="--model: tokens of (prompt, response) read."),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="0 = any free port."),
    token_file: Optional[Path] = typer.Option(None, "--token-file", help="File holding the bearer token "
                                              "(default: FLEETRL_REWARD_TOKEN); required beyond loopback."),
    token: Optional[str] = typer.Option(None, "--token", hidden=True, help="Refused: a token on the command "
                                        "line is visible in `ps`; use --token-file or FLEETRL_REWARD_TOKEN."),
    max_body_bytes: int = typer.Option(64 * 2**20, "--max-body-bytes"),
    timeout: float = typer.Option(30.0, "--timeout", help="Per-sample scoring limit (s)."),
    max_connections: int = typer.Option(32, "--max-connections", help="Requests handled at once; more get 503."),
    read_timeout: float = typer.Option(10.0, "--read-timeout", help="Seconds a client may take to send a request "
                                                                    "head, or stall while sending a body."),
) -> None:
    """Serve a reward function or a reward model over HTTP (GET /health, POST /score)."""
    # Refused, not warned: any user reads argv in `ps` while the server runs. Checked before the (slow) imports below;
    # the variable is rewards.server.TOKEN_ENV, spelled out here for the same reason.
    if token is not None:
        raise ValueError("--token on the command line is visible to every user of this machine in `ps`; pass the "
                         "token through the environment (FLEETRL_REWARD_TOKEN=TOKEN fleetrl serve-reward ...) or a "
                         "file (--token-file FILE, readable only by you), and choose a new token: this one was exposed")
    from fleetrl.config.load import build
    from fleetrl.config.reward_model import RewardModelConfig
    from fleetrl.rewards.server import ServeOptions, resolve_token, serve

    rm = None if model is None else build(RewardModelConfig, {"path": model, "kind": kind, "max_length": max_length},
                                          "--model")
    serve(ServeOptions(fn=fn, model=rm, host=host, port=port, token=resolve_token(token_file),
                       max_body_bytes=max_body_bytes, timeout_s=timeout, max_connections=max_connections,
                       read_timeout_s=read_timeout))


def register(app: typer.Typer) -> None:
    """Adds the cluster-operation commands to `app`."""
    cluster_app = typer.Typer(help="Start, inspect and stop Ray on this node.", no_args_is_help=True)
    cluster_app.command("up")(cluster_up)
    cluster_app.command("status")(cluster_status)
    cluster_app.command("down")(cluster_down)
    app.add_typer(cluster_app, name="cluster")
    jobs_app = typer.Typer(help="Jobs on a running cluster (Ray job API).", no_args_is_help=True)
    jobs_app.command("list")(jobs_list)
    jobs_app.command("status")(jobs_status)
    jobs_app.command("logs")(jobs_logs)
    jobs_app.command("stop")(jobs_stop)
    app.add_typer(jobs_app, name="jobs")
    for name, fn in (("doctor", doctor), ("submit", submit), ("slurm", slurm), ("dstack", dstack),
                     ("serve-reward", serve_reward)):
        app.command(name)(fn)
