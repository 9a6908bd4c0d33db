"""Network environment for collectives (NCCL, Gloo), from a named profile plus explicit overrides.

The result is written into the environment of the `ray start` process: the raylet inherits it and passes
it to every worker it spawns, so every actor on the node sees the same NCCL/Gloo settings without each
run repeating them in a runtime env.

`{iface}` in a profile value is replaced by the interface that carries the node's Ray IP. Pinning both
NCCL's bootstrap and Gloo to that interface matters: left alone, Gloo binds to whatever the hostname
resolves to (often 127.0.1.1 or a container bridge) and NCCL may pick a docker or VPN interface, and the
first collective across nodes then hangs.
"""
from __future__ import annotations

import fcntl
import socket
import struct
from typing import Mapping, Sequence

PROFILES: dict[str, dict[str, str]] = {
    "ib": {
        "NCCL_IB_DISABLE": "0",
        "NCCL_SOCKET_IFNAME": "{iface}",  # bootstrap/out-of-band only; data goes over the HCAs
        "GLOO_SOCKET_IFNAME": "{iface}",
        "NCCL_DEBUG": "WARN",
    },
    "ethernet": {
        "NCCL_IB_DISABLE": "1",
        "NCCL_SOCKET_IFNAME": "{iface}",
        "GLOO_SOCKET_IFNAME": "{iface}",
        # More sockets and threads per peer: one TCP stream per ring rarely fills a 100G link.
        "NCCL_SOCKET_NTHREADS": "4",
        "NCCL_NSOCKS_PERTHREAD": "4",
        "NCCL_DEBUG": "WARN",
    },
    "single-node": {
        "NCCL_IB_DISABLE": "1",
        "NCCL_SOCKET_IFNAME": "lo",
        "GLOO_SOCKET_IFNAME": "lo",
        "NCCL_DEBUG": "WARN",
    },
}


def parse_overrides(items: Sequence[str]) -> dict[str, str]:
    """["K=V", ...] -> {K: V}; raises ValueError on items without '=' or with an empty key."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--env {item!r} is not KEY=VALUE (e.g. --env NCCL_DEBUG=INFO)")
        out[key.strip()] = value
    return out


def network_env(profile: str | None, overrides: Mapping[str, str], *, node_ip: str) -> dict[str, str]:
    """The profile's variables (with `{iface}` filled in for `node_ip`), then `overrides` on top."""
    if profile is not None and profile not in PROFILES:
        raise ValueError(f"unknown network profile {profile!r}; choose one of {sorted(PROFILES)} "
                         f"or pass variables with --env KEY=VALUE")
    values = dict(PROFILES.get(profile, {})) if profile else {}
    if any("{iface}" in v for v in values.values()):
        iface = interface_for_ip(node_ip)
        if iface is None:
            raise ValueError(f"profile {profile!r} pins NCCL/Gloo to the interface carrying {node_ip}, but no "
                             f"interface on this node has that address; check --node-ip-address or set "
                             f"--env NCCL_SOCKET_IFNAME=... --env GLOO_SOCKET_IFNAME=...")
        values = {k: v.replace("{iface}", iface) for k, v in values.items()}
    return {**values, **overrides}


def interface_for_ip(ip: str) -> str | None:
    """Name of the local interface whose IPv4 address is `ip` (SIOCGIFADDR per interface), or None."""
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:  # interface without an IPv4 address
                continue
            if socket.inet_ntoa(packed[20:24]) == ip:
                return name
    return None
