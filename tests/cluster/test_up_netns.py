"""`fleetrl cluster up` + `doctor` on two "hosts" (network namespaces joined by a veth pair).

One cluster for the module: the head runs in namespace A, the worker in namespace B, which also has its own
mount namespace with a private tmpfs over `private/`: a directory that exists on both "hosts" but is not
shared, exactly what a node-local checkpoint path looks like to the doctor.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `tests.netns` whatever the pytest rootdir
from tests import netns  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "fleetrl.cli.main"]
REASON = netns.skip_reason()
needs_netns = [pytest.mark.netns, pytest.mark.skipif(REASON is not None, reason=REASON or "")]
PORT, DASHBOARD_PORT = 6391, 8275  # inside the namespaces: nothing else listens there


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "SLURM_", "DSTACK_"))
           and k not in ("NODE_RANK", "MASTER_ADDR")}
    return {**env, "HOME": str(home), "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0", **extra}


def _common(root: Path, name: str, host: netns.Host) -> list[str]:
    # Short temp dirs: Ray's unix socket paths live under them and must stay below 108 characters.
    # The worker has no --net-profile: `cluster up` must still pin Gloo to its node IP's interface (issue 18).
    profile = ["--net-profile", "ethernet"] if name == "head" else []
    return ["--token-file", str(root / "token"), "--state-file", str(root / f"{name}.json"),
            "--temp-dir", str(root / f"t{name[0]}"), *profile,
            "--env", "FLEETRL_NETNS_PROBE=set-by-cluster-up", "--num-cpus", "2",
            "--object-store-memory", str(80 * 2**20)]


@pytest.fixture(scope="module")
def cluster():
    if REASON is not None:
        pytest.skip(REASON)
    root = Path(tempfile.mkdtemp(prefix="frl", dir="/tmp"))
    (root / "shared").mkdir()
    (root / "private").mkdir()
    env = _env(root / "home")
    with netns.netns_pair() as (a, b):
        try:
            head = a.popen(CLI + ["cluster", "up", "--head", "--node-ip-address", a.ip, "--port", str(PORT),
                                  "--dashboard-port", str(DASHBOARD_PORT), "--expect-nodes", "2",
                                  "--wait-timeout", "120", *_common(root, "head", a)],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + 30
            while not (root / "token").exists():  # the head writes the token before starting Ray
                assert time.monotonic() < deadline and head.poll() is None, head.communicate()[0]
                time.sleep(0.1)
            # The worker's role comes from torchrun-style variables, not flags; --block keeps it in the
            # foreground (as under srun) until the head goes away.
            worker_log = open(root / "worker.out", "w")
            worker = b.popen(CLI + ["cluster", "up", "--port", str(PORT), "--join-timeout", "60", "--block",
                                    *_common(root, "worker", b)],
                             env={**env, "NODE_RANK": "1", "MASTER_ADDR": a.ip}, private_tmpfs=str(root / "private"),
                             stdout=worker_log, stderr=subprocess.STDOUT)
            head_out, _ = head.communicate(timeout=120)
            yield {"a": a, "b": b, "root": root, "env": env, "head_rc": head.returncode, "head_out": head_out,
                   "worker": worker}
            worker_log.close()
        finally:
            for name in ("worker", "head"):
                subprocess.run(CLI + ["cluster", "down", "--state-file", str(root / f"{name}.json")], env=env,
                               capture_output=True, timeout=60)
            shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow  # a `fleetrl cluster up` subprocess
def test_worker_without_token_fails_fast(tmp_path):
    """No token anywhere: the worker stops before waiting for the head, and says where the token goes."""
    start = time.monotonic()
    done = subprocess.run(CLI + ["cluster", "up", "--address", "127.0.0.1:9", "--join-timeout", "60",
                                 "--state-file", str(tmp_path / "s.json")],
                          env=_env(tmp_path / "home"), capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - start
    out = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 2, out
    assert elapsed < 15, f"took {elapsed:.1f}s: it waited for the head instead of failing fast"
    assert "no cluster auth token" in out
    for place in ("--token-file", "RAY_AUTH_TOKEN=", "RAY_AUTH_TOKEN_PATH=", str(tmp_path / "home/.ray/auth_token")):
        assert place in out, place
    assert not (tmp_path / "s.json").exists()


def test_wait_for_port_backs_off_until_the_head_listens():
    import socket
    import threading

    from fleetrl.cluster.up import wait_for_port

    # Bound but not listening, a port refuses connections and stays ours: no other process (pytest -n) can take
    # it between the choice and the listen, as it could when a port found free was closed and bound again later.
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    port = server.getsockname()[1]
    opener = threading.Timer(1.0, server.listen)
    start = time.monotonic()
    opener.start()
    try:
        wait_for_port("127.0.0.1", port, timeout_s=20, first_delay_s=0.1)
        assert 1.0 <= time.monotonic() - start < 5
    finally:
        opener.join()
        server.close()
    with socket.socket() as never:
        never.bind(("127.0.0.1", 0))
        port = never.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=f"127.0.0.1:{port} did not accept connections within 1s"):
            wait_for_port("127.0.0.1", port, timeout_s=1.0, first_delay_s=0.1)
        assert time.monotonic() - start < 3


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_worker_joins_from_env_and_head_wait_returns(cluster):
    root = cluster["root"]
    token = (root / "token").read_text().strip()
    assert cluster["head_rc"] == 0, cluster["head_out"]
    joined = f"joined {cluster['a'].ip}:{PORT} as worker {cluster['b'].ip} (role from torchrun)"
    deadline = time.monotonic() + 30  # the head may count the node a moment before the worker says so
    while joined not in (worker_out := (root / "worker.out").read_text()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert joined in worker_out, worker_out
    assert cluster["worker"].poll() is None, worker_out  # still blocking, as under srun
    head_out = cluster["head_out"]
    assert "2/2" in head_out  # the progress line reached both nodes
    assert f"fleetrl cluster up --address {cluster['a'].ip}:{PORT} --token-file {root / 'token'}" in head_out
    assert f"token {token[:4]}…" in head_out
    assert token not in head_out + worker_out  # never printed in full


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_network_env_reaches_actor_on_worker(cluster):
    a, b, root = cluster["a"], cluster["b"], cluster["root"]
    code = f"""
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
ray.init(address="{a.ip}:{PORT}", log_to_driver=False)
node = next(n for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == "{b.ip}")
@ray.remote(num_cpus=0)
class Probe:
    def env(self):
        import os
        return tuple(os.environ.get(k) for k in ("FLEETRL_NETNS_PROBE", "GLOO_SOCKET_IFNAME", "NCCL_IB_DISABLE"))
p = Probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)).remote()
print("ENV", ray.get(p.env.remote(), timeout=60))
"""
    env = {**cluster["env"], "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(root / "token")}
    done = a.run([sys.executable, "-c", code], env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"ENV ('set-by-cluster-up', '{b.iface}', None)" in done.stdout  # pinned without a profile


def _doctor(cluster, path: Path) -> subprocess.CompletedProcess:
    return cluster["a"].run(CLI + ["doctor", "--address", f"{cluster['a'].ip}:{PORT}", "--checkpoint-path",
                                   str(path), "--token-file", str(cluster["root"] / "token"),
                                   "--min-free-gb", "0.01", "--timeout", "60"],
                            env={**cluster["env"], "COLUMNS": "250"}, timeout=180)


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_doctor_passes_across_two_hosts(cluster):
    done = _doctor(cluster, cluster["root"] / "shared")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    out = done.stdout
    assert "✗" not in out
    for row in ("versions", "gpus", "shared filesystem", "ports", "disk", "all-reduce (gloo, 2 nodes)",
                "bus bandwidth"):
        assert row in out, row
    assert "shared by 2 node(s)" in out


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_doctor_fails_with_fix_when_checkpoint_path_not_shared(cluster):
    done = _doctor(cluster, cluster["root"] / "private")  # a tmpfs on the worker, a plain dir on the head
    assert done.returncode == 1, done.stdout + done.stderr[-3000:]
    out = " ".join(done.stdout.replace("│", " ").split())
    assert "✗" in out
    assert f"files written on {cluster['b'].ip} not visible on the head" in out
    assert "filesystem every node mounts at the same path" in out
    assert "all-reduce (gloo, 2 nodes)" in out  # the other checks still ran


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_status_then_down_stops_only_what_up_started_and_releases_the_worker(cluster):
    a, b, root, env = cluster["a"], cluster["b"], cluster["root"], cluster["env"]
    from fleetrl.cluster.up import read_state

    status = a.run(CLI + ["cluster", "status", "--state-file", str(root / "head.json")], env=env, timeout=60)
    assert status.returncode == 0, status.stdout + status.stderr
    assert f"head of {a.ip}:{PORT}" in status.stdout and a.ip in status.stdout and b.ip in status.stdout
    head_state, worker_state = read_state(root / "head.json"), read_state(root / "worker.json")
    bystander = subprocess.Popen(["sleep", "120"], start_new_session=True)  # another process group
    try:
        done = subprocess.run(CLI + ["cluster", "down", "--state-file", str(root / "head.json")], env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert f"stopped head (pid {head_state.pid})" in done.stdout
        assert netns.live_group_members(head_state.pid) == [] and not (root / "head.json").exists()
        assert bystander.poll() is None
        # The blocking worker notices the head is gone, stops its own Ray and exits 0 (the srun step ends).
        assert cluster["worker"].wait(timeout=60) == 0, (root / "worker.out").read_text()
        assert netns.live_group_members(worker_state.pid) == [] and not (root / "worker.json").exists()
    finally:
        bystander.kill()
        bystander.wait()
