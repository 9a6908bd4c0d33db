"""Each doctor check on hand-made facts; the CLI with no cluster checking this machine (the end-to-end run on two
hosts is in test_up_netns.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import typer
from rich.console import Console
from typer.testing import CliRunner

from fleetrl.cli import ops
from fleetrl.cluster import doctor as dr
from fleetrl.cluster.doctor import CheckResult, NodeInfo, NodeProbe
from fleetrl.config import PoolPlan

GB = 1024**3
V = {"python": "3.11.7", "torch": "2.13.0", "ray": "2.60.0", "fleetrl": "0.1.0"}


def _probe(ip: str, **kw) -> NodeProbe:
    base = dict(node_id=f"id-{ip}", ip=ip, versions=dict(V), gpus_present=0, visibility_env={},
                disk_free_bytes=100 * GB)
    return NodeProbe(**{**base, **kw})


def _node(ip: str, cpus: float, gpus: float = 0, head: bool = False) -> NodeInfo:
    res = {"CPU": cpus, "GPU": gpus, "memory": 64 * GB, **({dr.HEAD_RESOURCE: 1.0} if head else {})}
    return NodeInfo(node_id=f"id-{ip}", ip=ip, resources={k: v for k, v in res.items() if v})


def _plan(**pools: tuple[int, int, dict]) -> SimpleNamespace:
    return SimpleNamespace(pools={name: PoolPlan(name=name, nodes=n, bundles_per_node=b, bundle=bundle, roles=(),
                                           cpu_threads=1)
                                  for name, (n, b, bundle) in pools.items()})


def test_versions():
    assert dr.check_versions([_probe("a"), _probe("b")]).ok
    r = dr.check_versions([_probe("a"), _probe("b", versions={**V, "torch": "2.4.0"})])
    assert not r.ok and r.detail == "torch: a=2.13.0, b=2.4.0" and "same torch" in r.fix


def test_gpus_present_vs_what_ray_reports():
    nodes = [_node("a", 64, 8), _node("b", 64, 4)]
    r = dr.check_gpus([_probe("a", gpus_present=8), _probe("b", gpus_present=8)], nodes)
    assert not r.ok and r.detail == "b: 8 present, Ray reports 4" and "CUDA_VISIBLE_DEVICES" in r.fix
    assert dr.check_gpus([_probe("a", gpus_present=8), _probe("b", gpus_present=4)], nodes).detail == \
        "12 GPUs on 2 nodes"
    assert dr.check_gpus([_probe("a")], [_node("a", 2)]).detail == "CPU only"


def test_conflicting_visibility_env():
    ok = _probe("a", visibility_env={"CUDA_VISIBLE_DEVICES": "0,1", "HIP_VISIBLE_DEVICES": "0,1"})
    bad = _probe("b", visibility_env={"CUDA_VISIBLE_DEVICES": "0,1", "ROCR_VISIBLE_DEVICES": "2,3"})
    assert dr.check_visibility_env([ok]).ok
    r = dr.check_visibility_env([ok, bad])
    assert not r.ok and r.detail == "b: CUDA_VISIBLE_DEVICES=0,1, ROCR_VISIBLE_DEVICES=2,3"
    assert "set only one of" in r.fix


def test_placement_fits_and_colocates():
    nodes = [_node("a", 64, 8, head=True), _node("b", 64, 8)]
    r = dr.check_placement(_plan(actor=(2, 8, {"GPU": 1.0, "CPU": 0.25})), nodes)
    assert r.ok and r.detail == "actor: 2×8 bundles"
    # Two 4-GPU pools on one node each still fit on two 8-GPU nodes.
    assert dr.check_placement(_plan(actor=(2, 4, {"GPU": 1.0}), critic=(2, 4, {"GPU": 1.0})), nodes).ok


def test_placement_reports_what_was_asked_and_what_the_cluster_has():
    r = dr.check_placement(_plan(actor=(2, 8, {"GPU": 1.0, "CPU": 0.25})), [_node("a", 64, 8)])
    assert not r.ok
    assert "pool 'actor'" in r.detail and "asks for 2 node(s) × 8 worker(s)" in r.detail
    assert "GPU: needs 16, cluster has 8" in r.detail and "a [id-a]" in r.detail
    assert "cluster.pools.<pool>.nodes" in r.fix and "fleetrl cluster up --address" in r.fix
    # The second pool only sees what the first left: 8 + 8 GPUs do not fit on one 8-GPU node.
    r = dr.check_placement(_plan(actor=(1, 8, {"GPU": 1.0}), rollout=(1, 8, {"GPU": 1.0})), [_node("a", 8, 8)])
    assert not r.ok and r.detail.count("pool '") == 1


def test_shared_filesystem():
    path = Path("/ckpt")
    probes = [_probe("a"), _probe("b")]
    assert dr.check_shared_fs(path, probes, {"id-a", "id-b"}).ok
    r = dr.check_shared_fs(path, probes, {"id-a"})
    assert not r.ok and r.detail == "/ckpt: files written on b not visible on the head"
    assert "every node mounts at the same path" in r.fix
    r = dr.check_shared_fs(path, [_probe("a"), _probe("b", marker_error="Permission denied")], {"id-a"})
    assert r.detail == "/ckpt: cannot write on b (Permission denied)"


def test_ports_and_disk():
    assert dr.check_ports([_probe("a")]).ok
    r = dr.check_ports([_probe("a", unreachable=["b:6379 (Connection refused)"])])
    assert not r.ok and r.detail == "a -> b:6379 (Connection refused)" and "firewall" in r.fix
    r = dr.check_disk([_probe("a"), _probe("b", disk_free_bytes=5 * GB)], Path("/ckpt"), 20)
    assert not r.ok and r.detail == "free at /ckpt below 20.0 GB (--min-free-gb): b: 5.0 GB"
    assert (dr.check_disk([_probe("a")], Path("/ckpt"), 20).detail
            == "≥ 100.0 GB free at /ckpt on every node (needs 20.0 GB: --min-free-gb)")


def _opts(config: Path | None, min_free_gb: float | None = None) -> dr.DoctorOptions:
    return dr.DoctorOptions(address=None, checkpoint_path=Path("/ckpt"), config_path=config, min_free_gb=min_free_gb)


def test_disk_need_is_what_the_configs_run_writes(tmp_path):
    """The quickstart once failed `fleetrl doctor` on a machine with 15 GB free against a fixed 20 GB, for
    checkpoints of a few MB: the need is now the run's own (Plan.disk_bytes), the flag and the default kept."""
    from fleetrl.models.hf import load_causal_lm

    cfg = tmp_path / "run.yaml"
    cfg.write_text("model: {path: 'tiny:hidden=64'}\ntrainer: {total_steps: 10, save_every: 2, keep_last: 2}\n")
    params = sum(p.numel() for p in load_causal_lm("tiny:hidden=64").parameters())
    need, basis = dr.disk_need(_opts(cfg))
    # 5 saves, 3 held (keep_last + the one being written); float32 weights + 8 bytes of Adam state a parameter
    assert need == pytest.approx(1 + 3 * 12 * params / GB)
    assert "keep_last=2" in basis and "save_every=2" in basis
    assert dr.disk_need(_opts(cfg, 5.0)) == (5.0, "--min-free-gb")
    assert dr.disk_need(_opts(None))[0] == dr.DEFAULT_FREE_GB
    hub = tmp_path / "hub.yaml"
    hub.write_text("model: {path: 'some-org/some-model'}\n")
    need, basis = dr.disk_need(_opts(hub))
    assert need == dr.DEFAULT_FREE_GB and "not known before it loads" in basis


def test_allreduce_result():
    r = dr.allreduce_result({"seconds": 0.01, "mb": 16.0, "busbw_gbps": 1.68}, None, backend="gloo", world=2)
    assert r == CheckResult("all-reduce (gloo, 2 nodes)", True, "16 MB in 10.0 ms, bus bandwidth 1.68 GB/s")
    r = dr.allreduce_result(None, "DistStoreError: timed out", backend="nccl", world=4)
    assert not r.ok and "NCCL_SOCKET_IFNAME" in r.fix


def test_a_crashing_check_is_a_failed_row():
    def check_boom() -> CheckResult:
        raise KeyError("x")
    assert dr._safe(check_boom) == CheckResult("boom", False, "KeyError: 'x'", "see the detail")


def test_render_and_cli_exit_code(monkeypatch):
    results = [CheckResult("versions", True, "same"), CheckResult("disk", False, "1 GB", "free space")]
    console = Console(record=True, width=200)
    assert dr.render(results, console) is False
    text = console.export_text()
    assert "✓" in text and "✗" in text and "free space" in text

    monkeypatch.setattr(dr, "resolve_targets", lambda *a: ("h:1", Path("runs"), None))
    monkeypatch.setattr(dr, "run_doctor", lambda opts, token: results)
    app = typer.Typer()
    ops.register(app)
    out = CliRunner().invoke(app, ["doctor", "--address", "h:1"], env={"COLUMNS": "200"})
    assert out.exit_code == 1 and "free space" in out.output
    monkeypatch.setattr(dr, "run_doctor", lambda opts, token: results[:1])
    assert CliRunner().invoke(app, ["doctor", "--address", "h:1"]).exit_code == 0


def test_targets_without_a_cluster_mean_this_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert dr.resolve_targets(None, None, None, tmp_path / "none.json", None) == (None, Path("runs"), None)
    assert dr.resolve_targets(None, "h:1", None, tmp_path / "none.json", None) == ("h:1", Path("runs"), None)
    auto = tmp_path / "auto.yaml"
    auto.write_text("cluster: {address: auto}\n")
    with pytest.raises(ValueError, match=r"cluster.address=auto names no cluster to check: pass --address "
                                         r"HEAD_IP:PORT, .* `fleetrl cluster up --head` on the head node, then the "
                                         r"join command it prints \(`fleetrl cluster up --address HEAD_IP:6379"):
        dr.resolve_targets(auto, None, None, tmp_path / "none.json", None)


def test_no_cluster_checks_this_machine_and_says_how_to_add_machines(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # no `cluster up` state file
    seen = []
    monkeypatch.setattr(dr, "run_doctor", lambda opts, token: seen.append(opts) or [CheckResult("versions", True, "")])
    app = typer.Typer()
    ops.register(app)
    out = CliRunner().invoke(app, ["doctor", "examples/quickstart.yaml"], env={"COLUMNS": "400"})
    assert out.exit_code == 0, out.output
    assert seen[0].address is None and seen[0].checkpoint_path == Path("runs")
    assert "no cluster to check" in out.output and "checking this machine through a local Ray with" in out.output
    assert "`fleetrl cluster up --head` on the head node, then the join command it prints" in out.output


@pytest.mark.slow  # starts a local Ray (a subprocess, so this process keeps none)
def test_doctor_right_after_the_quickstart_checks_this_machine(tmp_path):
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "HOME": str(tmp_path), "COLUMNS": "200", "PYTHONPATH": str(repo)}
    done = subprocess.run([sys.executable, "-m", "fleetrl.cli.main", "doctor", str(repo / "examples/quickstart.yaml"),
                           "--checkpoint-path", str(tmp_path / "runs"), "--min-free-gb", "0.1"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [ln for ln in done.stdout.splitlines() if ln.startswith("│")]
    checks = {ln.split("│")[2].strip(): ln.split("│")[1].strip() for ln in rows}
    assert set(checks.values()) == {"✓"} and len(checks) == 8, done.stdout  # every check ran, none failed
    assert {"versions", "gpus", "shared filesystem", "ports", "disk", "placement"} <= set(checks), done.stdout
    assert "no cluster to check" in done.stderr
