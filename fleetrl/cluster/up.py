"""`fleetrl cluster up | status | down`: start Ray on this node as head or worker, and stop only that.

`cluster up` runs `ray start --block` in the background as a session leader and records its PID and start
time in a state file; `cluster down` stops that process and its process tree, nothing else. `ray stop` is
never used: it kills every Ray on the machine, including other users' and other tests' clusters.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Mapping

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from fleetrl.cluster import auth, netenv
from fleetrl.cluster.reaper import start_ticks
from fleetrl.cluster.roles import RoleDecision, detect_role
from fleetrl.config.load import redact_secrets, write_private

STARTED_MARKER = "Ray runtime started"


@dataclass(frozen=True, kw_only=True, slots=True)
class UpOptions:
    head: bool = False
    address: str | None = None
    """HEAD:PORT to join; wins over launcher variables."""
    port: int = 6379
    node_ip: str | None = None
    """This node's IP as Ray advertises it; detected from the route to the head when None."""
    expect_nodes: int = 1
    """Head only: total nodes (head included) to wait for."""
    wait_timeout_s: float = 600.0
    join_timeout_s: float = 600.0
    """Worker only: how long to wait for the head's port."""
    start_timeout_s: float = 120.0
    token_file: Path | None = None
    net_profile: str | None = None
    env: tuple[str, ...] = ()
    """KEY=VALUE overrides on top of the profile, for every Ray worker on this node."""
    dashboard_host: str = "127.0.0.1"
    dashboard_port: int = 8265
    num_cpus: int | None = None
    num_gpus: int | None = None
    object_store_memory: int | None = None
    temp_dir: Path | None = None
    state_file: Path | None = None
    ray_args: tuple[str, ...] = ()
    """Passed to `ray start` as is, e.g. "--dashboard-agent-listen-port=52366" when two clusters share a host."""


@dataclass(frozen=True, kw_only=True)
class ClusterState:
    """What `cluster up` started on this node; JSON in the state file."""

    role: str
    source: str
    address: str
    """GCS address of the cluster (head_ip:port)."""
    node_ip: str
    pid: int
    start_ticks: int
    """Process start time (/proc/PID/stat) so a recycled PID is never taken for ours."""
    log_path: str
    dashboard_url: str | None
    token_file: str | None
    token_masked: str
    env: dict[str, str] = field(default_factory=dict)


def default_state_file() -> Path:
    # Keyed by hostname: on a shared home every node would otherwise overwrite one file.
    return Path.home() / ".fleetrl" / f"cluster-{socket.gethostname()}.json"


def cluster_up(opts: UpOptions, *, env: Mapping[str, str] = os.environ, console: Console | None = None) -> ClusterState:
    """Starts Ray on this node in the role the flags or the launcher environment give; returns once the
    node is up (head: once `expect_nodes` nodes are alive). Raises on any failure with what to change."""
    console = console or Console(stderr=True)
    decision = detect_role(env, head=opts.head, address=opts.address, port=opts.port)
    state_file = opts.state_file or default_state_file()
    _refuse_if_running(state_file)
    token = (auth.create_or_reuse_token(env, opts.token_file) if decision.is_head
             else auth.find_token(env, opts.token_file))  # a worker without a token fails here, before waiting
    if not decision.is_head:
        wait_for_port(decision.head_host, decision.port, timeout_s=opts.join_timeout_s, console=console)
        # a wrong token: one line now, not `ray start` failing after 23 s with the reason on line 25 of its log
        auth.check_token(f"{decision.head_host}:{decision.port}", token)
    node_ip = opts.node_ip or detect_node_ip(decision.head_host)
    extra_env = netenv.network_env(opts.net_profile, netenv.parse_overrides(opts.env), node_ip=node_ip)
    if "GLOO_SOCKET_IFNAME" not in extra_env:
        console.print(f"[yellow]warning:[/] no interface here carries {node_ip}; Gloo/NCCL pick their own and may "
                      f"advertise a loopback address to other nodes; set --env GLOO_SOCKET_IFNAME=IFACE "
                      f"--env NCCL_SOCKET_IFNAME=IFACE", soft_wrap=True)
    if decision.is_head and opts.dashboard_host not in ("127.0.0.1", "localhost"):
        console.print(f"[yellow]warning:[/] the dashboard and job API listen on {opts.dashboard_host}; anyone "
                      f"who reaches port {opts.dashboard_port} can submit jobs if they hold the token, and "
                      f"traffic is unencrypted. Prefer the default 127.0.0.1 and an SSH tunnel.", soft_wrap=True)
    state = _launch(decision, opts, node_ip, token, extra_env, state_file, env, console)
    if decision.is_head:
        console.print(f"head up at {state.address} (token {state.token_masked} from {token.origin})", soft_wrap=True)
        wait_for_nodes(state.address, opts.expect_nodes, token, timeout_s=opts.wait_timeout_s, console=console)
        console.print(f"to add a node, run on it:\n  {join_command(state)}", soft_wrap=True, highlight=False)
    else:
        console.print(f"joined {state.address} as worker {node_ip} (role from {decision.source})", soft_wrap=True)
    return state


def join_command(state: ClusterState) -> str:
    token_arg = f" --token-file {state.token_file}" if state.token_file else " (with RAY_AUTH_TOKEN set)"
    return f"fleetrl cluster up --address {state.address}{token_arg}"


def detect_node_ip(peer: str | None) -> str:
    """The source IP of the route towards `peer` (the head), else of the default route; a UDP connect
    only selects a route, it sends nothing."""
    for target in [t for t in (peer, "8.8.8.8") if t]:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((target, 9))
                ip = s.getsockname()[0]
        except OSError:
            continue
        if not ip.startswith("127."):
            return ip
    raise ValueError(f"cannot detect this node's IP (no route to {peer or 'anywhere'} from a non-loopback "
                     f"address); pass --node-ip-address IP")


def wait_for_port(host: str, port: int, *, timeout_s: float, console: Console | None = None,
                  first_delay_s: float = 0.5, max_delay_s: float = 10.0) -> None:
    """Polls host:port with exponential backoff until it accepts a TCP connection, or TimeoutError."""
    deadline, delay, last = time.monotonic() + timeout_s, first_delay_s, "not tried"
    status = console.status(f"waiting for the head at {host}:{port}") if console else contextlib.nullcontext()
    with status:
        while True:
            try:
                with socket.create_connection((host, port), timeout=min(5.0, max_delay_s)):
                    return
            except OSError as e:
                last = e.strerror or str(e)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the head {host}:{port} did not accept connections within {timeout_s:.0f}s "
                                   f"(last error: {last}); start it with `fleetrl cluster up --head` and check "
                                   f"that this node can reach that address (firewall, --port)")
            time.sleep(min(delay, left))
            delay = min(delay * 2, max_delay_s)


def wait_for_nodes(address: str, expected: int, token: auth.ClusterToken | None, *, timeout_s: float,
                   console: Console | None = None, poll_s: float = 1.0) -> list[dict]:
    """Blocks until `expected` nodes are alive in the cluster at `address`; returns them. TimeoutError
    lists the nodes that did join."""
    with connected(address, token) as ray, _progress(console) as progress:
        task = progress.add_task(f"nodes alive (of {expected})", total=expected)
        deadline = time.monotonic() + timeout_s
        while True:
            alive = [n for n in ray.nodes() if n["Alive"]]
            progress.update(task, completed=min(len(alive), expected))
            if len(alive) >= expected:
                return alive
            if time.monotonic() > deadline:
                ips = ", ".join(n["NodeManagerAddress"] for n in alive)
                raise TimeoutError(f"{len(alive)} of {expected} nodes alive after {timeout_s:.0f}s ({ips}); start "
                                   f"the others with `fleetrl cluster up --address {address}` or lower "
                                   f"--expect-nodes. Ray keeps running here; `fleetrl cluster down` stops it")
            time.sleep(poll_s)


@contextlib.contextmanager
def connected(address: str, token: auth.ClusterToken | None) -> Iterator:
    """A Ray driver attached to `address` (never starts a cluster), with the token if there is one.
    The auth variables it sets are restored afterwards, so a library caller's environment is unchanged."""
    saved = {k: os.environ.get(k) for k in (auth.MODE_ENV, auth.TOKEN_ENV, auth.TOKEN_PATH_ENV)}
    if token is not None:
        auth.apply_token_env(os.environ, token)
    import ray  # deferred: importing ray costs ~1 s, and most commands never connect

    auth.reload_ray_auth()  # in case ray was imported before the variables changed
    try:
        auth.check_token(address, token)  # a wrong token: one line within seconds, not Ray's retries
        ray.init(address=address, log_to_driver=False, logging_level="WARNING", configure_logging=False)
        yield ray
    finally:
        ray.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        auth.reload_ray_auth()


@dataclass(frozen=True, kw_only=True)
class ClusterStatus:
    state: ClusterState | None
    running: bool
    nodes: list[dict] = field(default_factory=list)
    error: str | None = None


def cluster_status(state_file: Path | None = None, *, env: Mapping[str, str] = os.environ,
                   list_nodes: bool = True) -> ClusterStatus:
    state = read_state(state_file or default_state_file())
    if state is None:
        return ClusterStatus(state=None, running=False)
    running = _is_ours(state)
    if not (running and list_nodes):
        return ClusterStatus(state=state, running=running)
    token = auth.find_token_or_none(env, Path(state.token_file) if state.token_file else None)
    host, port = state.address.rsplit(":", 1)
    if not _port_open(host, int(port)):  # ray.init would retry for a minute before saying so
        return ClusterStatus(state=state, running=running, error=f"the head {state.address} is not reachable")
    try:
        with connected(state.address, token) as ray:
            nodes = ray.nodes()
    except Exception as e:  # status must report, not crash, when the head is gone
        return ClusterStatus(state=state, running=running, error=f"cannot list nodes at {state.address}: {e}")
    return ClusterStatus(state=state, running=running, nodes=nodes)


def cluster_down(state_file: Path | None = None, *, grace_s: float = 15.0) -> ClusterState | None:
    """Stops the Ray processes `cluster up` started on this node (their process group, by PID); removes
    the state file. Returns the state that was stopped, or None when nothing was recorded."""
    state_file = state_file or default_state_file()
    state = read_state(state_file)
    if state is None:
        return None
    if _is_ours(state):
        _stop_tree(state.pid, grace_s)
    state_file.unlink(missing_ok=True)
    return state


def block_until_exit(state_file: Path | None = None, *, poll_s: float = 5.0, head_gone_polls: int = 3) -> int:
    """Keeps this process in the foreground while Ray runs (srun and dstack end a step when its process
    exits). A worker returns 0 once the head has stopped answering for `head_gone_polls` polls (the run
    ended and the head went down), stopping its own Ray first; 1 when Ray died by itself. SIGTERM/SIGINT
    stop Ray and return 0."""
    def _stop(signum, _frame):
        raise KeyboardInterrupt
    state_file = state_file or default_state_file()
    state = read_state(state_file)
    if state is None:
        raise RuntimeError(f"no Ray started by `fleetrl cluster up` is recorded in {state_file}")
    signal.signal(signal.SIGTERM, _stop)
    host, port = state.address.rsplit(":", 1)
    misses = 0
    try:
        while _is_ours(state):
            time.sleep(poll_s)
            if state.role == "worker":
                misses = 0 if _port_open(host, int(port)) else misses + 1
                if misses >= head_gone_polls:
                    cluster_down(state_file, grace_s=3.0)  # short: draining needs the GCS that just left
                    return 0
        cluster_down(state_file)
        return 1
    except KeyboardInterrupt:
        cluster_down(state_file)
        return 0


def read_state(state_file: Path) -> ClusterState | None:
    try:
        return ClusterState(**json.loads(Path(state_file).read_text()))
    except FileNotFoundError:
        return None


# ----------------------------------------------------------------------------------------------- internals
def _launch(decision: RoleDecision, opts: UpOptions, node_ip: str, token: auth.ClusterToken,
            extra_env: dict[str, str], state_file: Path, env: Mapping[str, str], console: Console) -> ClusterState:
    address = f"{node_ip if decision.is_head else decision.head_host}:{decision.port}"
    cmd = ray_start_command(decision, opts, node_ip, address)
    proc_env = {**env, **extra_env, "RAY_USAGE_STATS_ENABLED": "0"}
    auth.apply_token_env(proc_env, token)
    state_file.parent.mkdir(parents=True, exist_ok=True)
    log_path = state_file.with_suffix(".log")
    with open(log_path, "w") as log, console.status(f"starting Ray ({decision.role}) on {node_ip}"):
        proc = subprocess.Popen(cmd, env=proc_env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        state = ClusterState(
            role=decision.role, source=decision.source, address=address, node_ip=node_ip, pid=proc.pid,
            start_ticks=start_ticks(proc.pid) or 0, log_path=str(log_path),
            dashboard_url=f"http://{opts.dashboard_host}:{opts.dashboard_port}" if decision.is_head else None,
            token_file=str(token.path.resolve()) if token.path else None, token_masked=token.masked,
            env=redact_secrets(extra_env))  # a record for people: `--env HF_TOKEN=...` must not land in it
        # written first, so `down` can always clean up; 0600: it names the token file
        write_private(state_file, json.dumps(asdict(state), indent=2))
        _wait_started(proc, log_path, opts.start_timeout_s, state_file)
    return state


def ray_start_command(decision: RoleDecision, opts: UpOptions, node_ip: str, address: str) -> list[str]:
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--disable-usage-stats",
           "--node-ip-address", node_ip]
    if decision.is_head:
        cmd += ["--head", "--port", str(decision.port), "--dashboard-host", opts.dashboard_host,
                "--dashboard-port", str(opts.dashboard_port)]
    else:
        cmd += ["--address", address]
    for flag, value in (("--num-cpus", opts.num_cpus), ("--num-gpus", opts.num_gpus),
                        ("--object-store-memory", opts.object_store_memory), ("--temp-dir", opts.temp_dir)):
        if value is not None:
            cmd += [flag, str(value)]
    return cmd + list(opts.ray_args)


def _wait_started(proc: subprocess.Popen, log_path: Path, timeout_s: float, state_file: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while STARTED_MARKER not in log_path.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                _stop_tree(proc.pid, grace_s=5.0)
            state_file.unlink(missing_ok=True)
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-25:])
            why = f"exited with code {proc.returncode}" if proc.returncode is not None else \
                f"did not start within {timeout_s:.0f}s"
            raise RuntimeError(f"`ray start` {why}; last lines of {log_path}:\n{tail}")
        time.sleep(0.2)


def _refuse_if_running(state_file: Path) -> None:
    state = read_state(state_file)
    if state is not None and _is_ours(state):
        raise RuntimeError(f"Ray started by `fleetrl cluster up` is already running here (pid {state.pid}, "
                           f"{state.role} of {state.address}); stop it with `fleetrl cluster down"
                           f"{' --state-file ' + str(state_file) if state_file != default_state_file() else ''}`")


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=3.0):
            return True
    except OSError:
        return False


def _progress(console: Console | None) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                    TimeElapsedColumn(), console=console or Console(stderr=True), transient=False)


def _is_ours(state: ClusterState) -> bool:
    ticks = start_ticks(state.pid)
    return ticks is not None and (state.start_ticks == 0 or ticks == state.start_ticks)


def _stop_tree(leader: int, grace_s: float) -> None:
    """Stops `ray start --block` (the leader) and everything it spawned.

    SIGTERM goes to the leader alone: it drains the node and stops its children in order, in ~2 s, whereas
    SIGTERM to every process at once leaves raylet and GCS waiting on each other for ~10 s. Whatever is left
    after grace_s gets SIGKILL: the leader's process group and its descendants, listed before signalling
    because Ray's workers lead their own process groups and are re-parented once the raylet exits.
    """
    members = _tree(leader)
    with contextlib.suppress(ProcessLookupError):
        os.kill(leader, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(start_ticks(p) == t for p, t in members.items()):
        with contextlib.suppress(ChildProcessError):  # reap the leader when this process is its parent
            os.waitpid(leader, os.WNOHANG)
        time.sleep(0.2)
    for pid, ticks in members.items():
        if start_ticks(pid) == ticks:  # same process still alive, not a recycled PID
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(leader, os.WNOHANG)


def _tree(leader: int) -> dict[int, int]:
    """PID -> start ticks of the leader, its process group and all its descendants (one /proc scan)."""
    children: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    found = {leader}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():  # self, thread-self, sys, ...
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # not a process, or it just exited
            continue
        pid = int(entry.name)
        children.setdefault(int(fields[1]), []).append(pid)
        ticks[pid] = int(fields[19])
        if int(fields[2]) == leader:
            found.add(pid)
    frontier = list(found)
    while frontier:
        for child in children.get(frontier.pop(), []):
            if child not in found:
                found.add(child)
                frontier.append(child)
    return {p: ticks[p] for p in found if p in ticks}
