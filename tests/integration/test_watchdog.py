"""Nothing waits forever: a frozen worker (SIGSTOP) is reported within cluster.stall_s with its pool, rank and
phase, its stacks are written under RUN/stalls/, and the run recovers from its checkpoint; a slow worker that
keeps making progress is left alone; SIGTERM stops after the step with a checkpoint and resumes exactly."""
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from fleetrl.trainer.metric_names import is_machine_metric
from tests.integration.helpers import read_metrics, train_run

pytestmark = pytest.mark.slow
BASE = ("model.path=tiny:", "data.prompts_per_step=8", "trainer.val_every=0", "trainer.val_before_train=false",
        "algorithm.micro_batch_size=16", "trainer.save_every=2", "cluster.stall_s=4", "trainer.restart_wait_s=30")


def _steps(records):
    return {r["step"] for r in records if "train/reward_mean" in r}


@pytest.mark.parametrize("verb,pools", [
    # the rank-local step (quickstart: one pool) and the same phases through the driver
    ("rollout_local", ()),
    ("update_actor_local", ()),
    ("generate", ("trainer.rank_local=false",)),
    # a separate rollout pool: the receiver freezes inside the bucketed weight broadcast
    ("bus_receive", ("cluster.pools={main: {cpus_per_worker: 0.25}, gen: {cpus_per_worker: 0.25}}",
                     "cluster.roles={actor: main, rollout: gen}")),
])
def test_frozen_worker_is_named_dumped_and_recovered(tmp_path, ray_local, verb, pools):
    out = tmp_path / "run"
    fault = f"{verb}:3:{tmp_path / 'fired'}"
    t0 = time.monotonic()
    records = train_run("examples/quickstart.yaml", out, *BASE, *pools, "trainer.total_steps=5",
                        "trainer.max_restarts=1", f"cluster.env={{FLEETRL_FAULT_STOP: '{fault}'}}")
    assert (tmp_path / "fired").exists(), "the fault never fired"
    stall = [r for r in records if r.get("event") == "stall"]
    assert len(stall) == 1, records
    phase = "weight_sync" if verb == "bus_receive" else verb
    assert f"in phase '{phase}'" in stall[0]["error"] and "rank 0 (node " in stall[0]["error"]
    assert "made no progress for" in stall[0]["error"] and "top frames of rank" in stall[0]["error"]
    dumps = list((out / "stalls").glob("step_*/*.txt"))
    assert dumps and any("Thread" in d.read_text() for d in dumps), [d.read_text()[:300] for d in dumps]
    assert _steps(records) == set(range(1, 6)) and any(r.get("event") == "resumed" for r in records)
    assert time.monotonic() - t0 < 150


def _ray_processes_of(pid: int) -> list[psutil.Process]:
    try:
        return [p for p in psutil.Process(pid).children(recursive=True) if p.is_running()]
    except psutil.NoSuchProcess:
        return []


def _cli(tmp_path, *args):
    return subprocess.Popen([sys.executable, "-m", "fleetrl.cli.main", "train", "examples/quickstart.yaml", *BASE,
                             "tracking.progress=false", f"trainer.output_dir={tmp_path / 'run'}", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_no_restarts_left_exits_nonzero_with_the_message_and_no_ray_left(tmp_path):
    proc = _cli(tmp_path, "trainer.total_steps=4", "trainer.max_restarts=0",
                f"cluster.env={{FLEETRL_FAULT_STOP: 'rollout_local:2:{tmp_path / 'fired'}'}}")
    children = []
    while proc.poll() is None and not children:
        time.sleep(1)
        children = _ray_processes_of(proc.pid)
    text, _ = proc.communicate(timeout=180)
    assert proc.returncode == 1, text
    error = [ln for ln in text.splitlines() if ln.startswith("error: ")]
    assert error and "pool 'main' rank 0" in error[0] and "in phase 'rollout_local'" in error[0], text[-2000:]
    assert "Traceback" not in text
    time.sleep(2)
    assert children, "the CLI ended before any Ray process of it was seen: nothing was checked"
    assert not [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], children


def test_slow_but_progressing_worker_is_not_killed(tmp_path, ray_local):
    # every decode step / micro-batch sleeps 1.5 s: a generate call (4 tokens) takes ~6 s > stall_s=4,
    # yet its progress count moves every 1.5 s, so it must not be reported
    records = train_run("examples/quickstart.yaml", tmp_path / "run", *BASE, "trainer.total_steps=2",
                        "cluster.env={FLEETRL_FAULT_BEAT_DELAY_S: '1.5'}", "trainer.max_restarts=0")
    assert _steps(records) == {1, 2}
    assert not [r for r in records if r.get("event") in ("stall", "restart")]
    assert [r for r in records if "train/time/generate" in r][-1]["train/time/generate"] > 4


def test_sigterm_checkpoints_and_resume_matches_a_straight_run(tmp_path, ray_local):
    steps = ("trainer.total_steps=6", "trainer.save_every=0")
    straight = train_run("examples/quickstart.yaml", tmp_path / "straight", *BASE, *steps)
    proc = _cli(tmp_path, *steps)
    metrics = tmp_path / "run" / "metrics.jsonl"
    while proc.poll() is None and not (metrics.exists() and '"step": 2' in metrics.read_text()):
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGTERM)
    text, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, text
    assert "continue with: fleetrl train" in text and "trainer.resume=auto" in text
    stopped = [r for r in read_metrics(tmp_path / "run") if r.get("event") == "stopped"][0]["step"]
    assert (tmp_path / "run" / "checkpoints" / f"step_{stopped}").is_dir()
    resumed = train_run("examples/quickstart.yaml", tmp_path / "run", *BASE, *steps, "trainer.resume=auto")

    def numbers(records, after):
        return {r["step"]: {k: v for k, v in r.items() if not is_machine_metric(k)}
                for r in records if "train/reward_mean" in r and r["step"] > after}
    assert numbers(resumed, stopped) == numbers(straight, stopped)
    assert set(numbers(resumed, stopped)) == set(range(stopped + 1, 7))
