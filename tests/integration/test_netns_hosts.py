"""Real separate hosts: a Ray head in one network namespace, a worker in another (joined with the auth token
through `fleetrl cluster up`), the critic pinned to the worker host.
 - two PPO steps run, and the critic ran on the worker host;
 - the worker host's Ray processes are killed mid-run, a replacement joins, and the run recovers and completes;
 - the worker host is killed and nothing replaces it: the configured fallback placement runs on the survivor.
Skips with the reason when not root or `ip netns` is unavailable (CI runs as root)."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tests import netns

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "fleetrl.cli.main"]
REASON = netns.skip_reason()
pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=REASON or "")]
PORT = 6393


def _env(root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "SLURM_", "DSTACK_"))
           and k not in ("NODE_RANK", "MASTER_ADDR")}
    return {**env, "HOME": str(root / "home"), "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(root / "token")}


def _up_args(root: Path, name: str) -> list[str]:
    return ["--token-file", str(root / "token"), "--state-file", str(root / f"{name}.json"),
            "--temp-dir", str(root / f"t{name}"), "--num-cpus", "2", "--object-store-memory", str(80 * 2**20)]


def _start_worker(b: netns.Host, a: netns.Host, root: Path, name: str) -> subprocess.Popen:
    log = open(root / f"{name}.out", "w")
    return b.popen(CLI + ["cluster", "up", "--port", str(PORT), "--join-timeout", "60", "--block",
                          *_up_args(root, name)], env={**_env(root), "NODE_RANK": "1", "MASTER_ADDR": a.ip},
                   stdout=log, stderr=subprocess.STDOUT)


@contextlib.contextmanager
def _two_hosts():
    """A Ray head on host A and a worker on host B joined through `fleetrl cluster up`; `cluster down` and the
    namespaces' removal after."""
    root = Path(tempfile.mkdtemp(prefix="frn", dir="/tmp"))
    env = _env(root)
    with netns.netns_pair() as (a, b):
        try:
            head = a.popen(CLI + ["cluster", "up", "--head", "--node-ip-address", a.ip, "--port", str(PORT),
                                  "--expect-nodes", "2", "--wait-timeout", "120", *_up_args(root, "head")],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + 30
            while not (root / "token").exists():
                assert time.monotonic() < deadline and head.poll() is None, head.communicate()[0]
                time.sleep(0.1)
            _start_worker(b, a, root, "worker")
            out, _ = head.communicate(timeout=150)
            assert head.returncode == 0, out
            yield a, b, root
        finally:
            for name in ("worker", "worker2", "head"):
                if (root / f"{name}.json").exists():
                    subprocess.run(CLI + ["cluster", "down", "--state-file", str(root / f"{name}.json")], env=env,
                                   capture_output=True, timeout=60)
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture()
def hosts():
    with _two_hosts() as h:
        yield h


@pytest.fixture(scope="module")
def shared_hosts():
    """One cluster for the tests at the end of the module (so that it is never up beside a test's own): the two-step
    run leaves it as it found it, the node-loss test after it kills its worker host last. A cluster costs ~20 s of
    CPU to bring up and down on the 2-core VM. Each test writes its own run directory."""
    with _two_hosts() as h:
        yield h


def _pools(a_ip: str, b_ip: str) -> list[str]:
    return ["cluster.pools={main: {cpus_per_worker: 0.5, resources: {'node:%s': 0.01}}, "
            "far: {cpus_per_worker: 0.5, resources: {'node:%s': 0.01}}}" % (a_ip, b_ip),
            "cluster.roles={actor: main, rollout: main, ref: main, critic: far}", "model.path=tiny:",
            "data.prompts_per_step=8", "algorithm.mini_batch_prompts=8", "data.val=null", "trainer.val_every=0"]


def _drive(a: netns.Host, root: Path, *overrides: str, run: str = "run",
           timeout: float = 400) -> subprocess.CompletedProcess:
    return a.run([sys.executable, str(REPO / "tests/integration/assets/netns_driver.py"), str(root / run),
                  f"cluster.address={a.ip}:{PORT}", *overrides], env=_env(root), timeout=timeout)


def _kill_host_at_step(b: netns.Host, metrics: Path, step: int, state: dict, then=None) -> threading.Thread:
    def kill() -> None:
        deadline = time.time() + 300
        while time.time() < deadline:
            lines = metrics.read_text().splitlines() if metrics.exists() else []
            if any(f'"step": {step}' in line and "train/" in line for line in lines):
                pids = subprocess.run(["ip", "netns", "pids", b.name], capture_output=True, text=True).stdout.split()
                for pid in pids:  # every Ray process of the worker host: the node is gone
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                state["killed"] = len(pids)
                if then is not None:
                    then()
                return
            time.sleep(0.3)

    t = threading.Thread(target=kill, daemon=True)
    t.start()
    return t


def test_node_loss_recovers_with_replacement(hosts):
    a, b, root = hosts
    metrics = root / "run" / "metrics.jsonl"
    state: dict = {}

    def replace() -> None:
        time.sleep(3)
        (root / "worker.json").unlink(missing_ok=True)
        _start_worker(b, a, root, "worker2")  # a replacement host joins at the same address

    t = _kill_host_at_step(b, metrics, 3, state, then=replace)
    done = _drive(a, root, *_pools(a.ip, b.ip), "trainer.total_steps=6", "trainer.save_every=2",
                  "trainer.max_restarts=2", "trainer.restart_wait_s=120", "cluster.placement_timeout_s=90", timeout=560)
    t.join(timeout=5)
    assert state.get("killed"), "the worker host was never killed"
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert any(r.get("event") == "restart" for r in records)
    assert {r["step"] for r in records if "train/reward_mean" in r} >= set(range(1, 7))


def test_frozen_host_is_detected_named_and_recovered_by_the_fallback(hosts):
    """Every process of host B SIGSTOPped (a frozen node, not a dead one): the watchdog reports the stall within
    cluster.stall_s with B's address, the supervisor waits for Ray to declare B dead before placing anything (a
    placement group aimed at a frozen node that Ray still counts alive holds up every later one, the fallback's
    included), and the run finishes on the fallback placement."""
    a, b, root = hosts
    metrics = root / "run" / "metrics.jsonl"
    frozen: list[int] = []
    frozen_at: list[float] = []

    def freeze() -> None:
        deadline = time.time() + 300
        while time.time() < deadline:
            if metrics.exists() and any('"step": 2' in l and "train/" in l for l in metrics.read_text().splitlines()):
                pids = subprocess.run(["ip", "netns", "pids", b.name], capture_output=True, text=True).stdout.split()
                for pid in pids:
                    os.kill(int(pid), signal.SIGSTOP)
                    frozen.append(int(pid))
                frozen_at.append(time.monotonic())
                return
            time.sleep(0.2)

    t = threading.Thread(target=freeze, daemon=True)
    t.start()
    fallback = ["cluster.fallback_pools={main: {cpus_per_worker: 0.5, resources: {'node:%s': 0.01}}}" % a.ip,
                "cluster.fallback_roles={actor: main, rollout: main, ref: main, critic: main}"]
    try:
        done = _drive(a, root, *_pools(a.ip, b.ip), *fallback, "trainer.total_steps=5", "trainer.save_every=1",
                      "trainer.max_restarts=4", "trainer.restart_wait_s=60", "cluster.placement_timeout_s=20",
                      "cluster.stall_s=6", timeout=560)
        finished_at = time.monotonic()
    finally:
        t.join(timeout=5)
        for pid in frozen:  # leave nothing stopped behind (the fixture's `cluster down` ends them)
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    assert frozen, "host B was never frozen"
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    records = [json.loads(l) for l in metrics.read_text().splitlines()]
    stalls = [r for r in records if r.get("event") == "stall"]
    assert stalls and f"(node {b.ip}," in stalls[0]["error"], stalls
    events = [r["event"] for r in records if "event" in r]
    # B's stack dump could not reach it, so the restart waited for Ray to declare it dead; then the original plan
    # could not fit and the fallback ran on this same restart
    assert [r["nodes"] for r in records if r.get("event") == "unresponsive_nodes"] == [[b.ip]], events
    assert events.count("restart") == 1 and "fallback_placement" in events, events
    # nothing was aimed at B after it froze: the pool pinned to it was placed once, before the freeze
    groups = json.loads(done.stdout.split("PLACEMENT_GROUPS ", 1)[1].splitlines()[0])
    assert [g for g in groups if g.startswith("fleetrl-far-")] == groups[1:2], groups
    assert {r["step"] for r in records if "train/reward_mean" in r} >= set(range(1, 6))
    # stall_s + the stack dumps' deadline (5 s) + at most restart_wait_s for Ray's verdict + 45 s to rebuild and finish
    assert finished_at - frozen_at[0] < 6 + 5 + 60 + 45, finished_at - frozen_at[0]


# The two tests on `shared_hosts` come last: the module's cluster is then up only after every test's own is down.
def test_two_steps_with_critic_on_worker_host(shared_hosts):
    a, b, root = shared_hosts
    done = _drive(a, root, *_pools(a.ip, b.ip), "trainer.total_steps=2")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    where = json.loads(done.stdout.split("WHERE ", 1)[1].splitlines()[0])
    assert where == {"actor": a.ip, "rollout": a.ip, "ref": a.ip, "critic": b.ip}
    steps = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if "train/critic/vf_loss" in s] == [1, 2]


def test_node_loss_falls_back_to_the_surviving_host(shared_hosts):
    """No replacement comes: after restart_wait_s the configured fallback placement (everything on host A) runs."""
    a, b, root = shared_hosts
    state: dict = {}
    t = _kill_host_at_step(b, root / "fallback" / "metrics.jsonl", 3, state)
    fallback = ["cluster.fallback_pools={main: {cpus_per_worker: 0.5, resources: {'node:%s': 0.01}}}" % a.ip,
                "cluster.fallback_roles={actor: main, rollout: main, ref: main, critic: main}"]
    t0 = time.monotonic()
    done = _drive(a, root, *_pools(a.ip, b.ip), *fallback, "trainer.total_steps=6", "trainer.save_every=2",
                  "trainer.max_restarts=1", "trainer.restart_wait_s=20", "cluster.placement_timeout_s=20", run="fallback",
                  timeout=500)
    elapsed = time.monotonic() - t0
    t.join(timeout=5)
    assert state.get("killed"), "the worker host was never killed"
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    where = json.loads(done.stdout.split("WHERE ", 1)[1].splitlines()[0])
    assert where["critic"] == a.ip, "after the fallback the critic runs on the surviving host"
    records = [json.loads(line) for line in (root / "fallback" / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("event") == "fallback_placement" for r in records)
    # the fallback happens on the FIRST restart: Ray already knows the host is gone, so nothing waits for it
    assert len([r for r in records if r.get("event") == "restart"]) == 1
    assert {r["step"] for r in records if "train/reward_mean" in r} >= set(range(1, 7))
    assert elapsed < 300, elapsed
