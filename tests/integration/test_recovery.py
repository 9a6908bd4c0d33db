"""A Ray worker process killed (SIGKILL, by PID) mid-run: the supervisor rebuilds the groups, resumes from the
last checkpoint and finishes every step; the restart is an event in metrics.jsonl."""
import json
import os
import signal
import threading
import time

import psutil
import pytest

from tests.integration.helpers import train_run

pytestmark = pytest.mark.slow


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def _kill_worker_when(out, step: int, killed: list) -> None:
    deadline = time.time() + 240
    metrics = out / "metrics.jsonl"
    while time.time() < deadline and not killed:
        if metrics.exists():
            steps = [json.loads(line).get("step", 0) for line in metrics.read_text().splitlines() if "train/" in line]
            if steps and max(steps) >= step:
                # Only this test's own Ray (started by this process): tests running alongside (pytest -n) have
                # workers of the same name, and killing theirs once failed an unrelated test.
                for p in psutil.Process().children(recursive=True):
                    if "ray::_RayWorker" in " ".join(_cmdline(p)):
                        os.kill(p.pid, signal.SIGKILL)
                        killed.append(p.pid)
                        return
        time.sleep(0.2)


def test_killed_worker_recovers(tmp_path, ray_local):
    out = tmp_path / "run"
    killed: list = []
    t = threading.Thread(target=_kill_worker_when, args=(out, 3, killed), daemon=True)
    t.start()
    records = train_run("examples/ppo_tiny.yaml", out, "model.path=tiny:", "data.prompts_per_step=8",
                        "algorithm.mini_batch_prompts=8", "trainer.total_steps=8", "trainer.save_every=2",
                        "trainer.max_restarts=2", "trainer.restart_wait_s=60", "trainer.val_every=0")
    t.join(timeout=5)
    assert killed, "the test never killed a worker"
    restarts = [r for r in records if r.get("event") == "restart"]
    resumed = [r for r in records if r.get("event") == "resumed"]
    assert len(restarts) == 1 and resumed
    assert restarts[0]["step"] - resumed[0]["step"] <= 2, "lost more steps than since the last checkpoint"
    done = {r["step"] for r in records if "train/reward_mean" in r}
    assert done == set(range(1, 9))
