"""`fleetrl doctor`: checks a running cluster against what a run needs, one row per check with its fix. With no
cluster to check (no --address, no `fleetrl cluster up` on this node, no cluster.address), it checks this machine
through a local Ray started for the check, as `fleetrl train` starts one.

Facts are gathered once (one probe task pinned to each node, one all-reduce across one actor per node);
each check is then a small function from those facts to a CheckResult, so checks are tested without a
cluster. Probes ask for no CPU so they run even on a cluster busy with a training run.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import shutil
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

from rich.console import Console
from rich.table import Table
from rich.text import Text

VISIBILITY_VARS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
# How machines become one cluster: the head prints the exact join command (its address and token file).
MULTI_NODE = ("`fleetrl cluster up --head` on the head node, then the join command it prints (`fleetrl cluster up "
              "--address HEAD_IP:6379 --token-file ...`) on each other node")
HEAD_RESOURCE = "node:__internal_head__"  # Ray gives this resource to the head node only
GB = 1024**3


@dataclass(frozen=True, slots=True)
class CheckResult:
    name: str
    ok: bool
    detail: str
    fix: str = ""


@dataclass(frozen=True, kw_only=True)
class NodeInfo:
    """One alive node as Ray reports it."""

    node_id: str
    ip: str
    resources: dict[str, float]
    ports: tuple[int, ...] = ()
    """Ports other nodes must reach on it (node manager, object manager; GCS on the head)."""

    @property
    def is_head(self) -> bool:
        return HEAD_RESOURCE in self.resources


@dataclass(frozen=True, kw_only=True)
class NodeProbe:
    """What the probe task saw on one node."""

    node_id: str
    ip: str
    versions: dict[str, str]
    gpus_present: int
    visibility_env: dict[str, str]
    """GPU-visibility variables in the environment `ray start` ran with (the raylet's)."""
    disk_free_bytes: int | None
    unreachable: list[str] = field(default_factory=list)
    marker_error: str | None = None


DEFAULT_FREE_GB = 20.0


@dataclass(frozen=True, kw_only=True)
class DoctorOptions:
    address: str | None
    """None: no cluster to check; this machine is checked through a local Ray started for the check."""
    checkpoint_path: Path
    config_path: Path | None = None
    min_free_gb: float | None = None
    """None: what the config's run writes (`disk_need`), else DEFAULT_FREE_GB."""
    timeout_s: float = 60.0
    allreduce_mb: float = 16.0


# ------------------------------------------------------------------------------------------------ checks
def check_versions(probes: list[NodeProbe]) -> CheckResult:
    by_node = {p.ip: p.versions for p in probes}
    differing = sorted({k for v in by_node.values() for k, x in v.items()
                        if len({other.get(k) for other in by_node.values()}) > 1})
    first = next(iter(by_node.values()), {})
    if not differing:
        return CheckResult("versions", True, ", ".join(f"{k} {v}" for k, v in first.items()))
    detail = "; ".join(f"{k}: " + ", ".join(f"{ip}={v.get(k)}" for ip, v in by_node.items()) for k in differing)
    return CheckResult("versions", False, detail,
                       f"install the same {', '.join(differing)} on every node (one image or one lock file)")


def check_gpus(probes: list[NodeProbe], nodes: list[NodeInfo]) -> CheckResult:
    ray_gpus = {n.node_id: int(n.resources.get("GPU", 0)) for n in nodes}
    wrong = [f"{p.ip}: {p.gpus_present} present, Ray reports {ray_gpus.get(p.node_id, 0)}"
             for p in probes if p.gpus_present != ray_gpus.get(p.node_id, 0)]
    if wrong:
        return CheckResult("gpus", False, "; ".join(wrong),
                           "unset CUDA_VISIBLE_DEVICES where `fleetrl cluster up` runs (Ray then sees every GPU) "
                           "or pass --num-gpus N to it")
    total = sum(ray_gpus.values())
    return CheckResult("gpus", True, f"{total} GPUs on {len(probes)} nodes" if total else "CPU only")


def check_visibility_env(probes: list[NodeProbe]) -> CheckResult:
    conflicts = []
    for p in probes:
        values = {k: v for k, v in p.visibility_env.items() if k in VISIBILITY_VARS}
        if len(set(values.values())) > 1:
            conflicts.append(f"{p.ip}: " + ", ".join(f"{k}={v}" for k, v in values.items()))
    if conflicts:
        return CheckResult("gpu visibility env", False, "; ".join(conflicts),
                           "set only one of CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES / ROCR_VISIBLE_DEVICES "
                           "(ROCm honours all three and they compose) before `fleetrl cluster up`")
    return CheckResult("gpu visibility env", True, "no conflicting *_VISIBLE_DEVICES")


def check_placement(plan: Any, nodes: list[NodeInfo]) -> CheckResult:
    """The run's pools against the nodes' capacity, by the same feasibility check the trainer runs before it
    creates placement groups (against capacity here, not what is free: a run may already be using it)."""
    from fleetrl.cluster.placement import NodeResources, PlacementError, check_feasible

    capacity = []
    for n in nodes:
        total = {k: v for k, v in n.resources.items() if not k.startswith("node:")}
        capacity.append(NodeResources(n.node_id, n.ip, total, dict(total)))
    try:
        check_feasible(list(plan.pools.values()), capacity)
    except PlacementError as e:
        return CheckResult("placement", False, str(e),
                           "lower cluster.pools.<pool>.nodes / workers_per_node / gpus_per_worker, or add nodes: "
                           f"{MULTI_NODE} (a node joins a running head with `fleetrl cluster up --address HEAD:PORT`)")
    return CheckResult("placement", True, ", ".join(f"{name}: {p.nodes}×{p.bundles_per_node} bundles"
                                                    for name, p in plan.pools.items()) or "no pools")


def check_shared_fs(path: Path, probes: list[NodeProbe], seen_by_head: set[str]) -> CheckResult:
    failed = [f"{p.ip} ({p.marker_error})" for p in probes if p.marker_error]
    unseen = [p.ip for p in probes if not p.marker_error and p.node_id not in seen_by_head]
    if failed or unseen:
        problems = ([f"cannot write on {', '.join(failed)}"] if failed else []) + \
            ([f"files written on {', '.join(unseen)} not visible on the head"] if unseen else [])
        return CheckResult("shared filesystem", False, f"{path}: {'; '.join(problems)}",
                           "put the checkpoint path on a filesystem every node mounts at the same path "
                           "(NFS, Lustre, ...) and set trainer.output_dir / --checkpoint-path to it")
    if len(probes) == 1:
        return CheckResult("shared filesystem", True, f"{path} writable; one node: nothing to share")
    return CheckResult("shared filesystem", True, f"{path} shared by {len(probes)} node(s)")


def check_ports(probes: list[NodeProbe]) -> CheckResult:
    bad = [f"{p.ip} -> {u}" for p in probes for u in p.unreachable]
    if bad:
        return CheckResult("ports", False, "; ".join(bad),
                           "open these TCP ports between the nodes (firewall / security group), or check "
                           "that each node advertises a reachable --node-ip-address")
    if len(probes) == 1:
        return CheckResult("ports", True, "one node: no other node's ports to reach")
    return CheckResult("ports", True, "every node reaches the others' Ray ports")


def check_disk(probes: list[NodeProbe], path: Path, min_free_gb: float, basis: str = "--min-free-gb") -> CheckResult:
    low = [f"{p.ip}: {'unknown' if p.disk_free_bytes is None else f'{p.disk_free_bytes / GB:.1f} GB'}"
           for p in probes if p.disk_free_bytes is None or p.disk_free_bytes < min_free_gb * GB]
    if low:
        return CheckResult("disk", False, f"free at {path} below {min_free_gb:,.1f} GB ({basis}): {'; '.join(low)}",
                           "free space there, point --checkpoint-path / trainer.output_dir at a larger disk, keep "
                           "fewer checkpoints (trainer.keep_last), or set --min-free-gb where you know the run "
                           "needs less (a LoRA run's checkpoints hold its adapters only)")
    least = min(p.disk_free_bytes or 0 for p in probes) / GB if probes else 0
    return CheckResult("disk", True, f"≥ {least:.1f} GB free at {path} on every node (needs {min_free_gb:,.1f} GB: "
                                     f"{basis})")


def allreduce_result(timing: Mapping[str, float] | None, error: str | None, *, backend: str,
                     world: int) -> CheckResult:
    name = f"all-reduce ({backend}, {world} nodes)"
    if error is not None:
        return CheckResult(name, False, error,
                           "set NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME to the interface of each node's IP "
                           "(`fleetrl cluster up --net-profile ethernet|ib`) and open ports between nodes")
    bandwidth = f"bus bandwidth {timing['busbw_gbps']:.2f} GB/s" if world > 1 else "one node: no network crossed"
    return CheckResult(name, True, f"{timing['mb']:.0f} MB in {timing['seconds'] * 1e3:.1f} ms, {bandwidth}")


# --------------------------------------------------------------------------------------------- the driver
def run_doctor(opts: DoctorOptions, token: Any = None) -> list[CheckResult]:
    """Connects to the cluster at opts.address (no address: starts a local Ray), gathers facts, runs every check."""
    from fleetrl.cluster.up import connected

    results: list[CheckResult] = []
    path = Path(opts.checkpoint_path).expanduser().resolve()
    with connected(opts.address, token) if opts.address else _local_ray(opts.config_path) as ray:
        nodes = _alive_nodes(ray, opts.address or "")
        probes, seen, probe_error = _gather_probes(ray, nodes, path, opts.timeout_s)
        if probe_error:
            results.append(CheckResult("probe", False, probe_error,
                                       "install fleetrl (same version) on every node and check each node's logs"))
        else:
            results += [_safe(check_versions, probes), _safe(check_gpus, probes, nodes),
                        _safe(check_visibility_env, probes), _safe(check_shared_fs, path, probes, seen),
                        _safe(check_ports, probes), _safe(check_disk, probes, path, *disk_need(opts))]
        if opts.config_path is not None:
            results.append(_safe(_placement_from_config, opts.config_path, nodes))
        results.append(_run_allreduce(ray, nodes, opts))
    return results


def local_note(cpus: int | None) -> str:
    """What `fleetrl doctor` says before checking this machine instead of a cluster."""
    return (f"no cluster to check (no --address, no `fleetrl cluster up` on this node, no cluster.address in the "
            f"config): checking this machine through a local Ray with {cpus or os.cpu_count()} CPUs, as `fleetrl "
            f"train` starts one. To run on several machines: {MULTI_NODE}; then run `fleetrl doctor` on the head")


def local_cpus(config_path: Path | None) -> int | None:
    """cluster.num_cpus of the config: the CPUs `fleetrl train` gives the local Ray it starts (None: all)."""
    if config_path is None:
        return None
    from fleetrl.config import load_config

    return load_config(config_path).cluster.num_cpus


@contextlib.contextmanager
def _local_ray(config_path: Path | None) -> Iterator[Any]:
    """A local Ray for the check, sized like the one `fleetrl train` starts; shut down afterwards."""
    import ray

    # address="local": never joins a cluster a stale file points to (what cluster.address unset means to train)
    ray.init(address="local", num_cpus=local_cpus(config_path) or os.cpu_count(), include_dashboard=False,
             log_to_driver=False, logging_level="WARNING", configure_logging=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def resolve_targets(config_path: Path | None, address: str | None, checkpoint_path: Path | None,
                    state_file: Path | None, token_file: Path | None) -> tuple[str | None, Path, Path | None]:
    """Fills what the user left out: address and token file from this node's `cluster up` state, else the
    config's cluster.address, else None (no cluster: check this machine); checkpoint path from
    trainer.output_dir, else ./runs."""
    from fleetrl.cluster.up import default_state_file, read_state

    state = read_state(state_file or default_state_file())
    cfg = None
    if config_path is not None:
        from fleetrl.config import load_config

        cfg = load_config(config_path)
    if address is None:
        address = state.address if state else (cfg.cluster.address if cfg else None)
    if address == "auto":  # a run's way to join the cluster it is submitted to: doctor needs the head's address
        raise ValueError(f"cluster.address=auto names no cluster to check: pass --address HEAD_IP:PORT, or run "
                         f"`fleetrl doctor` on a head started with `fleetrl cluster up --head` (multi-node: "
                         f"{MULTI_NODE})")
    if checkpoint_path is None:
        checkpoint_path = Path(cfg.trainer.output_dir) if cfg and cfg.trainer.output_dir else Path("runs")
    if token_file is None and state is not None and state.token_file:
        token_file = Path(state.token_file)
    return address, checkpoint_path, token_file


def render(results: Iterable[CheckResult], console: Console | None = None) -> bool:
    """Prints the table; True when every check passed."""
    table = Table(title="fleetrl doctor")
    for col in ("", "check", "detail", "fix"):
        table.add_column(col, overflow="fold")
    ok = True
    for r in results:
        ok &= r.ok
        # details and fixes quote error text (paths, `[/...]` log lines): literal Text, never markup
        table.add_row("[green]✓[/]" if r.ok else "[red]✗[/]", Text(r.name), Text(r.detail),
                      Text(r.fix if not r.ok else ""))
    (console or Console()).print(table)
    return ok


def _safe(check: Callable[..., CheckResult], *args: Any) -> CheckResult:
    try:
        return check(*args)
    except Exception as e:  # a broken check is a failed row, never a crashed doctor
        return CheckResult(check.__name__.removeprefix("check_").removeprefix("_"), False, f"{type(e).__name__}: {e}",
                           "see the detail")


def disk_need(opts: DoctorOptions) -> tuple[float, str]:
    """The free GB each node needs and why: --min-free-gb where given; else what the config's run writes
    (Plan.disk_bytes for the model's parameter count, plus 1 GB for logs and scratch); else DEFAULT_FREE_GB. Why:
    a fixed 20 GB failed the quickstart, whose checkpoints take a few MB, on a machine with 15 GB free."""
    if opts.min_free_gb is not None:
        return opts.min_free_gb, "--min-free-gb"
    if opts.config_path is None:
        return DEFAULT_FREE_GB, "the default with no config to size the run by"
    from fleetrl.config import derive_plan, load_config
    from fleetrl.models.hf import parameter_count

    cfg = load_config(opts.config_path)
    try:
        plan = derive_plan(cfg)
        params = parameter_count(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
    except Exception:  # a config the Plan refuses fails the placement row with its reason; size by the default
        return DEFAULT_FREE_GB, "the default: the config did not give a plan to size the run by"
    if params is None:
        return DEFAULT_FREE_GB, f"the default: the size of model.path={cfg.model.path} is not known before it loads"
    t = cfg.trainer
    return 1 + plan.disk_bytes(params) / GB, (f"the run's checkpoints for {params / 1e9:.3g}B parameters at "
                                               f"trainer.keep_last={t.keep_last}, save_every={t.save_every}, "
                                               f"and 1 GB for logs")


def _placement_from_config(config_path: Path, nodes: list[NodeInfo]) -> CheckResult:
    from fleetrl.config import derive_plan, load_config

    return check_placement(derive_plan(load_config(config_path)), nodes)


def _alive_nodes(ray: Any, address: str) -> list[NodeInfo]:
    gcs_port = int(address.rsplit(":", 1)[1]) if ":" in address else None
    out = []
    for n in ray.nodes():
        if not n["Alive"]:
            continue
        res = dict(n["Resources"])
        ports = (n["NodeManagerPort"], n["ObjectManagerPort"])
        if HEAD_RESOURCE in res and gcs_port:
            ports += (gcs_port,)
        out.append(NodeInfo(node_id=n["NodeID"], ip=n["NodeManagerAddress"], resources=res, ports=ports))
    return sorted(out, key=lambda n: (not n.is_head, n.ip))


def _gather_probes(ray: Any, nodes: list[NodeInfo], path: Path,
                   timeout_s: float) -> tuple[list[NodeProbe], set[str], str | None]:
    from fleetrl.cluster.placement import pinned_to

    marker_dir = path / f".fleetrl-doctor-{uuid.uuid4().hex[:8]}"
    targets = [(n.ip, port) for n in nodes for port in n.ports]
    probe, read, clean = (ray.remote(f) for f in (_probe_node, _list_markers, _remove_markers))
    try:
        probes = ray.get([probe.options(**pinned_to(n.node_id)).remote(n.node_id, str(path), str(marker_dir), targets)
                          for n in nodes], timeout=timeout_s)
        head = next((n for n in nodes if n.is_head), nodes[0])
        seen = set(ray.get(read.options(**pinned_to(head.node_id)).remote(str(marker_dir)), timeout=timeout_s))
        ray.get([clean.options(**pinned_to(n.node_id)).remote(str(marker_dir), n.node_id) for n in nodes],
                timeout=timeout_s)
    except Exception as e:
        return [], set(), f"probe tasks failed or timed out after {timeout_s:.0f}s: {type(e).__name__}: {e}"
    return probes, seen, None


def _run_allreduce(ray: Any, nodes: list[NodeInfo], opts: DoctorOptions) -> CheckResult:
    from fleetrl.cluster.placement import pinned_to

    backend = "nccl" if nodes and all(n.resources.get("GPU", 0) >= 1 for n in nodes) else "gloo"
    peer_cls = ray.remote(_Peer)
    peers = [peer_cls.options(num_gpus=1 if backend == "nccl" else 0, **pinned_to(n.node_id)).remote() for n in nodes]
    try:
        master, port = ray.get(peers[0].rendezvous.remote(), timeout=opts.timeout_s)
        refs = [p.allreduce.remote(rank, len(peers), master, port, backend, opts.allreduce_mb, opts.timeout_s)
                for rank, p in enumerate(peers)]
        timings = ray.get(refs, timeout=opts.timeout_s + 15)
    except Exception as e:
        msg = str(e).strip().splitlines()
        return allreduce_result(None, f"{type(e).__name__}: {msg[-1] if msg else ''} (timeout {opts.timeout_s:.0f}s)",
                                backend=backend, world=len(nodes))
    finally:
        for p in peers:
            ray.kill(p)
    return allreduce_result(max(timings, key=lambda t: t["seconds"]), None, backend=backend, world=len(nodes))


# ---------------------------------------------------------------------------- code that runs on each node
def _probe_node(node_id: str, path: str, marker_dir: str, targets: list[tuple[str, int]]) -> NodeProbe:
    me = _node_ip()
    marker_error = None
    try:
        Path(marker_dir).mkdir(parents=True, exist_ok=True)
        (Path(marker_dir) / node_id).write_text(me)
    except OSError as e:
        marker_error = e.strerror or str(e)
    return NodeProbe(node_id=node_id, ip=me, versions=_versions(), gpus_present=_gpus_present(),
                     visibility_env={k: v for k, v in _raylet_env().items() if k in VISIBILITY_VARS},
                     disk_free_bytes=_disk_free(Path(path)),
                     unreachable=[u for ip, port in targets if ip != me and (u := _unreachable(ip, port))],
                     marker_error=marker_error)


def _list_markers(marker_dir: str) -> list[str]:
    try:
        return os.listdir(marker_dir)
    except OSError:
        return []


def _remove_markers(marker_dir: str, node_id: str) -> None:
    (Path(marker_dir) / node_id).unlink(missing_ok=True)
    try:
        Path(marker_dir).rmdir()
    except OSError:  # other nodes' markers still there (shared fs) or already gone
        pass


class _Peer:
    """One rank of the doctor's all-reduce; rank 0 also picks the rendezvous port."""

    def rendezvous(self) -> tuple[str, int]:
        ip = _node_ip()
        with socket.socket() as s:
            s.bind((ip, 0))
            return ip, s.getsockname()[1]

    def allreduce(self, rank: int, world: int, master: str, port: int, backend: str, mb: float,
                  timeout_s: float) -> dict[str, float]:
        import datetime

        import torch
        import torch.distributed as dist

        dist.init_process_group(backend, init_method=f"tcp://{master}:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        try:
            device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
            x = torch.full((int(mb * 2**20) // 4,), float(rank + 1), device=device)
            dist.all_reduce(x)  # warm-up: connection setup is not bandwidth
            x.fill_(float(rank + 1))
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            dist.all_reduce(x)
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            expected = world * (world + 1) / 2
            if not torch.allclose(x[:16].cpu(), torch.full((16,), expected)):
                raise RuntimeError(f"all-reduce returned {x[0].item()} instead of {expected}")
        finally:
            dist.destroy_process_group()
        nbytes = x.numel() * 4
        return {"seconds": seconds, "mb": nbytes / 2**20,
                "busbw_gbps": 2 * (world - 1) / world * nbytes / seconds / 1e9 if world > 1 else 0.0}


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _versions() -> dict[str, str]:
    import ray
    import torch

    try:
        fleetrl_version = importlib.metadata.version("fleetrl")
    except importlib.metadata.PackageNotFoundError:
        fleetrl_version = "source"
    return {"python": platform.python_version(), "torch": torch.__version__, "ray": ray.__version__,
            "fleetrl": fleetrl_version}


def _gpus_present() -> int:
    """GPUs physically on the node, whatever the visibility variables say."""
    if shutil.which("nvidia-smi"):
        done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        if done.returncode == 0:
            return sum(1 for line in done.stdout.splitlines() if line.startswith("GPU "))
    kfd = Path("/sys/class/kfd/kfd/topology/nodes")  # AMD: CPU nodes have gpu_id 0
    if kfd.is_dir():
        return sum(1 for n in kfd.iterdir() if (n / "gpu_id").is_file() and (n / "gpu_id").read_text().strip() != "0")
    return 0


def _raylet_env() -> dict[str, str]:
    """The environment `ray start` ran with: the raylet is this worker's parent; Ray edits our own env."""
    try:
        raw = Path(f"/proc/{os.getppid()}/environ").read_bytes()
        return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)
    except OSError:
        return dict(os.environ)


def _disk_free(path: Path) -> int | None:
    for candidate in (path, *path.parents):
        if candidate.exists():
            return shutil.disk_usage(candidate).free
    return None


def _unreachable(ip: str, port: int) -> str | None:
    try:
        with socket.create_connection((ip, port), timeout=3.0):
            return None
    except OSError as e:
        return f"{ip}:{port} ({e.strerror or e})"
