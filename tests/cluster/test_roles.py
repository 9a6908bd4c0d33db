"""What `fleetrl cluster up` decides before it starts Ray: the role, the token, the network env, the command."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from fleetrl.cluster import auth, netenv
from fleetrl.cluster.roles import RoleDecision, detect_role, expand_nodelist, split_address
from fleetrl.cluster.up import UpOptions, ray_start_command


# ------------------------------------------------------------------------------------------ node lists
@pytest.mark.parametrize("nodelist, hosts", [
    ("gpu-[0-3,7]", ["gpu-0", "gpu-1", "gpu-2", "gpu-3", "gpu-7"]),
    ("a[01-02],b3", ["a01", "a02", "b3"]),
    ("node17", ["node17"]),
    ("x[8-10]", ["x8", "x9", "x10"]),
    ("r[1-2]-n[08-09]", ["r1-n08", "r1-n09", "r2-n08", "r2-n09"]),
    ("c[1,3],d[099-100],e", ["c1", "c3", "d099", "d100", "e"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["", "gpu-[a-b]", "gpu-[1-x]"])
def test_expand_nodelist_rejects_garbage(bad):
    with pytest.raises(ValueError, match="SLURM node list"):
        expand_nodelist(bad)


# --------------------------------------------------------------------------------------------- roles
def _role(env, *, head=False, address=None, port=6379) -> RoleDecision:
    return detect_role(env, head=head, address=address, port=port)


def test_slurm_first_node_of_the_list_is_the_head():
    env = {"SLURM_JOB_NODELIST": "gpu-[3-4,9]", "SLURM_NODEID": "0", "SLURM_PROCID": "0"}
    assert _role(env) == RoleDecision("head", "gpu-3", 6379, "slurm")
    assert _role({**env, "SLURM_NODEID": "2", "SLURM_PROCID": "2"}) == RoleDecision("worker", "gpu-3", 6379, "slurm")


def test_slurm_procid_used_when_nodeid_missing():
    assert _role({"SLURM_NODELIST": "a[01-02],b3", "SLURM_PROCID": "1"}).role == "worker"
    assert _role({"SLURM_NODELIST": "a[01-02],b3", "SLURM_PROCID": "0"}).head_host == "a01"


def test_dstack():
    env = {"DSTACK_NODE_RANK": "0", "DSTACK_MASTER_NODE_IP": "10.1.0.4"}
    assert _role(env) == RoleDecision("head", "10.1.0.4", 6379, "dstack")
    assert _role({**env, "DSTACK_NODE_RANK": "3"}, port=7000) == RoleDecision("worker", "10.1.0.4", 7000, "dstack")


def test_torchrun_style_uses_master_addr_but_not_master_port():
    env = {"NODE_RANK": "1", "MASTER_ADDR": "10.2.0.1", "MASTER_PORT": "29500"}
    assert _role(env) == RoleDecision("worker", "10.2.0.1", 6379, "torchrun")
    assert _role({**env, "NODE_RANK": "0"}).role == "head"


def test_explicit_flags_win_over_the_environment():
    slurm_worker = {"SLURM_JOB_NODELIST": "gpu-[0-1]", "SLURM_NODEID": "1"}
    assert _role(slurm_worker, head=True) == RoleDecision("head", None, 6379, "--head")
    assert _role({"NODE_RANK": "0", "MASTER_ADDR": "h"}, address="10.0.0.5:7000") == \
        RoleDecision("worker", "10.0.0.5", 7000, "--address")
    assert _role({}, address="head-node", port=6380) == RoleDecision("worker", "head-node", 6380, "--address")


def test_slurm_wins_over_torchrun_variables():
    env = {"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NODEID": "1", "NODE_RANK": "0", "MASTER_ADDR": "other"}
    assert _role(env) == RoleDecision("worker", "n1", 6379, "slurm")


def test_conflicting_flags_and_no_information_are_errors():
    with pytest.raises(ValueError, match="not both"):
        _role({}, head=True, address="h:1")
    with pytest.raises(ValueError, match="--head .*SLURM_NODEID.*DSTACK_NODE_RANK.*NODE_RANK"):
        _role({"MASTER_ADDR": "h"})  # half of a launcher's variables is not enough
    with pytest.raises(ValueError, match="NODE_RANK='one'"):
        _role({"NODE_RANK": "one", "MASTER_ADDR": "h"})


def test_split_address():
    assert split_address("10.0.0.1:6390", default_port=1) == ("10.0.0.1", 6390)
    assert split_address("[fe80::1]:7000", default_port=1) == ("fe80::1", 7000)
    assert split_address("[fe80::1]", default_port=6379) == ("fe80::1", 6379)
    with pytest.raises(ValueError, match="HOST:PORT"):
        split_address("a:b:c", default_port=1)


# --------------------------------------------------------------------------------------------- token
def test_find_token_order_flag_then_rays_own(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("default-token\n")
    (tmp_path / "f").write_text("file-token")
    (tmp_path / "p").write_text("path-token")
    env = {"RAY_AUTH_TOKEN": "env-token", "RAY_AUTH_TOKEN_PATH": str(tmp_path / "p")}
    assert auth.find_token(env, tmp_path / "f").value == "file-token"
    assert auth.find_token(env).value == "env-token"
    assert auth.find_token({"RAY_AUTH_TOKEN_PATH": str(tmp_path / "p")}).value == "path-token"
    assert auth.find_token({}).value == "default-token"


def test_missing_token_names_every_place(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(auth.TokenMissingError) as err:
        auth.find_token({})
    for place in ("--token-file", "RAY_AUTH_TOKEN=", "RAY_AUTH_TOKEN_PATH=", str(tmp_path / ".ray/auth_token")):
        assert place in str(err.value)
    with pytest.raises(auth.TokenMissingError, match="shares with the head"):
        auth.find_token({}, tmp_path / "nope")


def test_head_creates_a_private_token_once_and_reuses_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    made = auth.create_or_reuse_token({}, tmp_path / "shared" / "token")
    assert len(made.value) == 64 and int(made.value, 16) >= 0  # Ray's format: 32 random bytes, hex
    assert stat.S_IMODE(os.stat(made.path).st_mode) == 0o600
    assert auth.create_or_reuse_token({}, tmp_path / "shared" / "token").value == made.value
    default = auth.create_or_reuse_token({})  # no flag, nothing in env: Ray's default path
    assert default.path == tmp_path / "home" / ".ray" / "auth_token"
    assert made.masked == made.value[:4] + "…" and made.value not in made.masked


def test_token_env_for_ray_prefers_the_path(tmp_path):
    (tmp_path / "t").write_text("abcd1234")
    env = {"RAY_AUTH_TOKEN": "stale"}
    auth.apply_token_env(env, auth.find_token({}, tmp_path / "t"))
    assert env == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str((tmp_path / "t").resolve())}
    env = {"RAY_AUTH_TOKEN_PATH": "/stale"}
    auth.apply_token_env(env, auth.find_token({"RAY_AUTH_TOKEN": "v"}))
    assert env == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "v"}


# ----------------------------------------------------------------------------------------- network env
def test_profile_pins_nccl_and_gloo_to_the_interface_of_the_node_ip():
    env = netenv.network_env("ethernet", {"NCCL_DEBUG": "INFO"}, node_ip="127.0.0.1")
    assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "lo"
    assert env["NCCL_IB_DISABLE"] == "1" and env["NCCL_DEBUG"] == "INFO"  # overrides win
    assert netenv.network_env("ib", {}, node_ip="127.0.0.1")["NCCL_IB_DISABLE"] == "0"
    # no profile: still pinned to the node IP's interface (loopback here), overrides on top
    assert netenv.network_env(None, {"A": "1"}, node_ip="127.0.0.1") == \
        {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "=lo", "A": "1"}


def test_network_env_errors():
    with pytest.raises(ValueError, match="unknown network profile 'infiniband'"):
        netenv.network_env("infiniband", {}, node_ip="127.0.0.1")
    with pytest.raises(ValueError, match="no interface on this node has that address"):
        netenv.network_env("ib", {}, node_ip="192.0.2.123")  # TEST-NET-1: never assigned here
    with pytest.raises(ValueError, match="KEY=VALUE"):
        netenv.parse_overrides(["NCCL_DEBUG"])
    assert netenv.parse_overrides(["A=1", "B=x=y", "C="]) == {"A": "1", "B": "x=y", "C": ""}


# ----------------------------------------------------------------------------------------- ray start
def test_ray_start_always_names_the_node_ip_and_keeps_the_dashboard_local():
    opts = UpOptions(head=True, port=6390, num_gpus=0, temp_dir=Path("/tmp/x"))
    cmd = ray_start_command(RoleDecision("head", None, 6390, "--head"), opts, "10.0.0.1", "10.0.0.1:6390")
    assert cmd[cmd.index("--node-ip-address") + 1] == "10.0.0.1"
    assert cmd[cmd.index("--dashboard-host") + 1] == "127.0.0.1"
    assert {"--head", "--block"} <= set(cmd) and cmd[cmd.index("--port") + 1] == "6390"
    assert cmd[cmd.index("--num-gpus") + 1] == "0" and cmd[cmd.index("--temp-dir") + 1] == "/tmp/x"
    worker = ray_start_command(RoleDecision("worker", "h", 6390, "slurm"), UpOptions(), "10.0.0.2", "h:6390")
    assert worker[worker.index("--address") + 1] == "h:6390" and "--head" not in worker
    assert worker[worker.index("--node-ip-address") + 1] == "10.0.0.2"
