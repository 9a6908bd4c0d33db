"""bench/async_e2e.py: the 4-GPU modes' Plans derive on CPU (pools, prompts, settings), the engine slot cap fits
the card and is applied, a mode past its timeout reports instead of hanging, and (slow) the 4-worker CPU smoke of
the async splits runs end to end."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import async_e2e as ae

ROOT = Path(__file__).resolve().parents[2]
H100, H200 = int(79.6 * ae.GIB), int(139.8 * ae.GIB)


def plan(mode: str, *argv: str):
    return ae.mode_plan(mode, ae.parse_args(["--gpus", "4", *argv]), Path("/tmp/unused"))


@pytest.mark.parametrize("shape", ["qwen3-8b", "qwen2.5-7b"])
def test_the_4gpu_modes_derive_their_plans_with_whole_groups_per_actor_rank(shape):
    sync, a13, a22 = (plan(m, "--shape", shape) for m in ("sync", "async13", "async22"))
    assert dict(sync.world) == {"actor": 4, "rollout": 4} and sync.rollout_colocated and sync.pipeline is None
    assert sync.config.actor.offload_optimizer and sync.config.actor.sharding == "fsdp2"
    assert dict(a13.world) == {"actor": 3, "rollout": 1} and a13.config.data.prompts_per_step == 66
    assert dict(a22.world) == {"actor": 2, "rollout": 2} and a22.config.data.prompts_per_step == 64
    for p in (a13, a22):
        assert p.pipeline.max_staleness == 1 and p.config.algorithm.rollout_correction.mode == "tis"
        assert not p.config.actor.offload_optimizer  # nothing else shares an actor GPU
    assert {p.config.model.path for p in (sync, a13, a22)} == {f"random:{shape}"}
    assert sync.config.rollout.max_new_tokens == 4096 and sync.samples_per_step == 512


def test_a_split_the_host_lacks_is_refused_before_any_run():
    with pytest.raises(SystemExit, match="does not split 2 GPUs; choose sync or one of \\['async', 'asyncs'\\]"):
        ae.parse_args(["--gpus", "2", "--modes", "sync,async13"])
    assert ae.parse_args(["--gpus", "4", "--shape", "qwen2.5-7b"]).tag == "_4gpu_qwen2.5-7b"


def test_engine_slots_cap_what_the_card_cannot_hold():
    """Qwen3-8B's KV cache is 0.6 GiB a slot at 4,256 positions: 128 colocated slots fit an H200, not an H100;
    Qwen2.5-7B's (0.23 GiB) fit both."""
    slots, est = ae.engine_slots(plan("sync"), H100)
    assert 40 < slots < 128 and est["kv_slot_gib"] == pytest.approx(36 * 8 * 128 * 2 * 2 * 4256 / ae.GIB)
    assert ae.engine_slots(plan("sync"), H200)[0] == 128
    assert ae.engine_slots(plan("sync", "--shape", "qwen2.5-7b"), H100)[0] == 128
    rollout_only, est = ae.engine_slots(plan("async22"), H100)
    assert slots < rollout_only < 256 and est["weights_gib"] == pytest.approx(8.19e9 * 2 / ae.GIB, rel=0.01)


def test_the_slots_reach_the_run_as_rollout_gpu_memory_fraction():
    """The estimate's slots travel as rollout.gpu_memory_fraction, which the engine turns back into that many slots
    (engines/fast/engine.py: budget // slot bytes): no monkeypatch of the engine in the workers."""
    p = plan("async22")
    slots = ae.engine_slots(p, H100)[0]
    override = ae.slots_fraction(p, slots, H100)
    fraction = float(override.split("=")[1])
    slot = 36 * 8 * 128 * 2 * 2 * p.rollout.max_seq_len  # Qwen3-8B: layers x KV heads x head_dim x (k, v) x bf16
    assert int(fraction * H100) // slot == slots < p.rollout.max_batch
    bounded = ae.mode_plan("async22", ae.parse_args(["--gpus", "4"]), Path("/tmp/unused"), override)
    assert bounded.config.rollout.gpu_memory_fraction == fraction


def test_a_mode_past_its_timeout_reports_instead_of_hanging(monkeypatch):
    monkeypatch.setattr(ae.ray, "init", lambda **kw: None)
    monkeypatch.setattr(ae.ray, "shutdown", lambda: None)
    monkeypatch.setattr(ae, "run_plan", lambda plan, run_dir: time.sleep(30))
    monkeypatch.setenv(ae.ENV, "6,16,0")
    t0 = time.time()
    assert ae.launch(None, Path("/tmp/unused"), 1) == "stopped by --mode-timeout 1 s"
    assert time.time() - t0 < 10
    lines = ae.summary({"sync": {"error": "stopped by --mode-timeout 1 s"}})
    assert lines[0] == "sync: stopped by --mode-timeout 1 s" and "2,478" in lines[-1]


@pytest.mark.slow
def test_the_4_worker_cpu_smoke_runs_both_async_splits(tmp_path):
    """FSDP2 actors of 3 and 2 ranks publishing through the object store to rollout pools of 1 and 2 workers."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "async_e2e.py"), "--smoke", "--gpus", "4", "--modes",
                          "async13,async22", "--out", str(tmp_path)], capture_output=True, text=True, timeout=280,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    for mode, pools, prompts in (("async13", {"actor": 3, "rollout": 1}, 9), ("async22", {"actor": 2, "rollout": 2}, 8)):
        r = json.loads((tmp_path / f"async_e2e_{mode}_4gpu_smoke.json").read_text())
        assert r["pools"] == pools and r["prompts_per_step"] == prompts and "error" not in r
        assert sum(r["staleness_hist"].values()) == 3 * prompts * 4  # 3 measured steps of prompts × 4 samples
        assert set(r["pool_idle_frac"]) == {"train", "gen"} and "ratio_mean" in r["rollout_is"]
    assert "async22 {'actor': 2, 'rollout': 2}" in out.stdout and "one-step off-policy 2,478" in out.stdout


def test_an_s_suffix_streams_the_split_and_nothing_else():
    streamed, plain, sync = plan("async13s"), plan("async13"), plan("sync")
    assert streamed.pipeline.stream and streamed.config.rollout.engine == "fast"
    assert dict(streamed.world) == dict(plain.world) == {"actor": 3, "rollout": 1}
    assert not plain.pipeline.stream and sync.pipeline is None
    assert "async22s" in ae.parse_args(["--gpus", "4", "--modes", "sync,async22s"]).modes
