"""Gloo/NCCL bind to the interface of the node's Ray IP: the lookup, `cluster up`'s default env, and the worker's
fallback when the raylet did not set one."""
import functools
import os

import pytest

from fleetrl import netif
from fleetrl.cluster import netenv
from fleetrl.workers import worker

TABLE = {"lo": "127.0.0.1", "docker0": "172.17.0.1", "eth0": "10.1.2.3", "eth0.100": "10.9.0.3"}


def test_interface_lookup_in_a_fake_table():
    assert netif.interface_for_ip("10.1.2.3", TABLE) == "eth0"
    assert netif.interface_for_ip("127.0.0.1", TABLE) == "lo"
    assert netif.interface_for_ip("192.0.2.1", TABLE) is None
    # NCCL matches prefixes: "=eth0" keeps it off eth0.100; Gloo's names are exact
    assert netif.socket_ifname_env("10.1.2.3", TABLE) == {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "=eth0"}
    assert netif.socket_ifname_env("192.0.2.1", TABLE) == {}


def test_this_machine_has_loopback():
    assert netif.local_interfaces().get("lo") == "127.0.0.1"


def test_cluster_up_pins_by_default_and_overrides_win():
    assert netenv.network_env(None, {}, node_ip="10.1.2.3", interfaces=TABLE) == \
        {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "=eth0"}
    assert netenv.network_env(None, {"GLOO_SOCKET_IFNAME": "ib0"}, node_ip="10.1.2.3", interfaces=TABLE) == \
        {"GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "=eth0"}
    # an IP no interface holds (behind NAT): no pin rather than an error, the libraries choose
    assert netenv.network_env(None, {}, node_ip="192.0.2.1", interfaces=TABLE) == {}
    assert netenv.network_env("ethernet", {}, node_ip="10.1.2.3", interfaces=TABLE)["GLOO_SOCKET_IFNAME"] == "eth0"


@pytest.fixture
def fake_node(monkeypatch):
    for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(worker, "socket_ifname_env", functools.partial(netif.socket_ifname_env, table=TABLE))
    return monkeypatch


def test_worker_pins_the_node_ip_interface_when_nothing_is_set(fake_node):
    fake_node.setenv("FLEETRL_NODE_IP", "10.1.2.3")
    worker._pin_socket_ifname()
    assert (os.environ["GLOO_SOCKET_IFNAME"], os.environ["NCCL_SOCKET_IFNAME"]) == ("eth0", "=eth0")


@pytest.mark.parametrize("ip, preset", [("127.0.0.1", {}), ("10.1.2.3", {"GLOO_SOCKET_IFNAME": "ib0"}),
                                        ("192.0.2.1", {})])
def test_worker_leaves_loopback_explicit_and_unknown_alone(fake_node, ip, preset):
    fake_node.setenv("FLEETRL_NODE_IP", ip)
    for k, v in preset.items():
        fake_node.setenv(k, v)
    worker._pin_socket_ifname()
    assert {k: os.environ[k] for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if k in os.environ} == preset
