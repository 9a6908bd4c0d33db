"""Network environment for collectives (NCCL, Gloo), from a named profile plus explicit overrides.

Without a profile, NCCL and Gloo are still pinned to the interface of the node's Ray IP (`fleetrl.netif`), so
cross-node process groups never advertise a loopback address; `--env` overrides win over both.

The result is written into the environment of the `ray start` process: the raylet inherits it and passes
it to every worker it spawns, so every actor on the node sees the same NCCL/Gloo settings without each
run repeating them in a runtime env.

`{iface}` in a profile value is replaced by the interface that carries the node's Ray IP. Pinning both
NCCL's bootstrap and Gloo to that interface matters: left alone, Gloo binds to whatever the hostname
resolves to (often 127.0.1.1 or a container bridge) and NCCL may pick a docker or VPN interface, and the
first collective across nodes then hangs.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from fleetrl.netif import interface_for_ip, socket_ifname_env

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


def network_env(profile: str | None, overrides: Mapping[str, str], *, node_ip: str,
                interfaces: Mapping[str, str] | None = None) -> dict[str, str]:
    """The profile's variables (with `{iface}` filled in for `node_ip`), or without a profile the socket
    interface of `node_ip` when this node has it; then `overrides` on top. `interfaces`: {name: IPv4}
    (default: this machine's)."""
    if profile is not None and profile not in PROFILES:
        raise ValueError(f"unknown network profile {profile!r}; choose one of {sorted(PROFILES)} "
                         f"or pass variables with --env KEY=VALUE")
    if profile is None:
        return {**socket_ifname_env(node_ip, interfaces), **overrides}
    values = dict(PROFILES[profile])
    if any("{iface}" in v for v in values.values()):
        iface = interface_for_ip(node_ip, interfaces)
        if iface is None:
            raise ValueError(f"profile {profile!r} pins NCCL/Gloo to the interface carrying {node_ip}, but no "
                             f"interface on this node has that address; check --node-ip-address or set "
                             f"--env NCCL_SOCKET_IFNAME=... --env GLOO_SOCKET_IFNAME=...")
        values = {k: v.replace("{iface}", iface) for k, v in values.items()}
    return {**values, **overrides}
