"""Which local network interface carries an IPv4 address: what NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME must name
so that collectives bind to the node's cluster IP. Left alone, Gloo binds to whatever the hostname resolves to
(often 127.0.1.1, or 127.0.0.1 in a container) and advertises that to its peers, and NCCL may pick a docker or VPN
interface; the first collective across nodes then hangs.

Stdlib only (workers and `cluster up` both use it; no Ray)."""
from __future__ import annotations

import fcntl
import socket
import struct
from collections.abc import Mapping

SIOCGIFADDR = 0x8915  # <linux/sockios.h>: an interface's IPv4 address


def local_interfaces() -> dict[str, str]:
    """{interface name: its (primary) IPv4 address} for every interface that has one."""
    out: dict[str, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on this interface
                continue
            out[name] = socket.inet_ntoa(packed[20:24])  # struct ifreq: 16-byte name, then sockaddr_in
    return out


def interface_for_ip(ip: str, table: Mapping[str, str] | None = None) -> str | None:
    """Name of the interface whose IPv4 address is `ip` in `table` (default: this machine's), or None."""
    table = local_interfaces() if table is None else table
    return next((name for name, addr in table.items() if addr == ip), None)


def socket_ifname_env(ip: str, table: Mapping[str, str] | None = None) -> dict[str, str]:
    """GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME for the interface carrying `ip`; {} when none does (an address
    behind NAT, say), leaving the libraries' own choice. NCCL reads its value as a prefix unless it starts with
    "=", so "=eth0" keeps it off eth0.100; Gloo takes exact names."""
    iface = interface_for_ip(ip, table)
    return {} if iface is None else {"GLOO_SOCKET_IFNAME": iface, "NCCL_SOCKET_IFNAME": f"={iface}"}
