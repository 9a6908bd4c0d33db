"""Which node is the head, from flags or from what the launcher put in the environment.

`detect_role` is pure (env in, decision out) so every launcher is unit-tested without one. Precedence:
explicit flags (`--head`, `--address`), then SLURM, dstack, torchrun-style variables. The head is the node
of rank 0; workers join the head's address on the Ray port (never MASTER_PORT, which is torch's port).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, Mapping

Role = Literal["head", "worker"]


@dataclass(frozen=True, slots=True)
class RoleDecision:
    role: Role
    head_host: str | None
    """Address workers join (hostname or IP); None for a head started with `--head` (it is this node)."""
    port: int
    source: str
    """What decided: "--head", "--address", "slurm", "dstack" or "torchrun"."""

    @property
    def is_head(self) -> bool:
        return self.role == "head"


def detect_role(env: Mapping[str, str], *, head: bool, address: str | None, port: int) -> RoleDecision:
    """Role and head address for `fleetrl cluster up`; flags win over the environment.

    Raises ValueError when flags conflict or nothing tells the role.
    """
    if head and address:
        raise ValueError(f"--head and --address {address} both given; a node is either the head (--head) "
                         f"or joins one (--address HOST:PORT), not both")
    if head:
        return RoleDecision("head", None, port, "--head")
    if address:
        host, joined_port = split_address(address, default_port=port)
        return RoleDecision("worker", host, joined_port, "--address")
    for source, detect in (("slurm", _from_slurm), ("dstack", _from_dstack), ("torchrun", _from_torchrun)):
        found = detect(env)
        if found is not None:
            rank, head_host = found
            return RoleDecision("head" if rank == 0 else "worker", head_host, port, source)
    raise ValueError("cannot tell whether this node is the head: pass --head on the head node and "
                     "--address HEAD_IP:PORT on the others, or run under a launcher that sets "
                     "SLURM_NODEID + SLURM_JOB_NODELIST, DSTACK_NODE_RANK + DSTACK_MASTER_NODE_IP, or "
                     "NODE_RANK + MASTER_ADDR")


def split_address(address: str, *, default_port: int) -> tuple[str, int]:
    """"host:port" / "host" / "[v6]:port" -> (host, port)."""
    m = re.fullmatch(r"\[(?P<v6>[^\]]+)\](?::(?P<p6>\d+))?|(?P<host>[^:\[\]]+)(?::(?P<port>\d+))?", address)
    if m is None:
        raise ValueError(f"address {address!r} is not HOST:PORT (e.g. 10.0.0.1:6379)")
    host = m.group("v6") or m.group("host")
    port = m.group("p6") or m.group("port")
    return host, int(port) if port else default_port


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list, expanded in order: "gpu-[0-3,7]" -> gpu-0..gpu-3, gpu-7;
    "a[01-02],b3" -> a01, a02, b3; "r[1-2]-n[1-2]" -> r1-n1, r1-n2, r2-n1, r2-n2 (zero padding kept)."""
    hosts: list[str] = []
    for item in _split_top_level(nodelist.strip()):
        expanded = [""]
        for literal, ranges in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", item):
            choices = _expand_ranges(ranges, nodelist) if ranges else [""]
            expanded = [prefix + literal + c for prefix in expanded for c in choices]
        hosts.extend(expanded)
    if not hosts or any(not h for h in hosts):
        raise ValueError(f"cannot parse SLURM node list {nodelist!r}")
    return hosts


def _split_top_level(text: str) -> list[str]:
    """Splits on commas outside brackets: "a[1,2],b" -> ["a[1,2]", "b"]."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p]


def _expand_ranges(ranges: str, whole: str) -> list[str]:
    out: list[str] = []
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"cannot parse range {part!r} in SLURM node list {whole!r}")
        width = len(lo)  # "01-10" keeps two digits
        out.extend(str(n).zfill(width) for n in range(int(lo), int(hi or lo) + 1))
    return out


def _rank(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        value = env.get(name, "").strip()
        if value:
            if not value.isdigit():
                raise ValueError(f"{name}={value!r} is not a node rank (a non-negative integer)")
            return int(value)
    return None


def _from_slurm(env: Mapping[str, str]) -> tuple[int, str] | None:
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    # SLURM_NODEID is the node's index within the job; SLURM_PROCID equals it with one task per node.
    rank = _rank(env, "SLURM_NODEID", "SLURM_PROCID")
    if not nodelist or rank is None:
        return None
    return rank, expand_nodelist(nodelist)[0]


def _from_dstack(env: Mapping[str, str]) -> tuple[int, str] | None:
    rank, master = _rank(env, "DSTACK_NODE_RANK"), env.get("DSTACK_MASTER_NODE_IP")
    return None if rank is None or not master else (rank, master)


def _from_torchrun(env: Mapping[str, str]) -> tuple[int, str] | None:
    rank, master = _rank(env, "NODE_RANK", "GROUP_RANK"), env.get("MASTER_ADDR")
    return None if rank is None or not master else (rank, master)
