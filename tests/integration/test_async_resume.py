"""Resume loses nothing (issue 38, item 4): an async run whose driver is SIGKILLed in the middle of a step, after a
checkpoint, and resumed with trainer.resume=auto to the same total trains every prompt of every epoch exactly once,
and the same prompts in the same steps as an uninterrupted run (prompts.jsonl, trainer/prompt_log.py). The
checkpoint holds the (k+1)·P groups of the window (in flight or finished, none trained yet), and the resumed run
generates them again, oldest first, before it draws new prompts (docs/async.md, Resume)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from fleetrl.trainer.prompt_log import trained_prompts
from tests.integration.helpers import train_run
from tests.integration.test_async import SHORT, SPLIT

pytestmark = pytest.mark.slow  # a `fleetrl train` subprocess killed mid-run, and two in-process runs
REPO = Path(__file__).resolve().parents[2]
CONFIG = f"{REPO}/examples/quickstart.yaml"
EPOCH, P, TOTAL = 24, 8, 6  # 24 prompts, 8 a step: an epoch is 3 steps, the run 2 epochs
COMMON = (*SHORT, *SPLIT, "trainer.mode=async", f"data.train=synthetic:copy?n={EPOCH}&split=train", "rollout.n=4",
          f"trainer.total_steps={TOTAL}")


def _train_steps(out: Path) -> list[int]:
    metrics = out / "metrics.jsonl"
    if not metrics.exists():
        return []
    steps = []
    for line in metrics.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:  # the line being written
            continue
        if "train/reward_mean" in rec:
            steps.append(rec["step"])
    return steps


def _killed_mid_step(out: Path, kill_after: int, *args: str) -> None:
    """Runs `fleetrl train` and SIGKILLs its driver as soon as step `kill_after` is logged (that step is saved
    before it is logged): it is then inside step kill_after + 1. Ray's processes die with the driver (fate sharing,
    and the reaper of cluster/reaper.py)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "fleetrl.cli.main", "train", CONFIG, *COMMON, *args,
                             "tracking.progress=false", "tracking.console=false", f"trainer.output_dir={out}"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 180
    while proc.poll() is None and time.monotonic() < deadline and max(_train_steps(out), default=0) < kill_after:
        time.sleep(0.05)
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    text, _ = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, text[-3000:]
    assert max(_train_steps(out)) == kill_after, (_train_steps(out), text[-2000:])  # killed before the next step


STREAMED = ("rollout.engine=fast", "trainer.stream_rollouts=true")


@pytest.mark.parametrize("k,save_every,kill_after,extra", [
    (1, 2, 3, ()),  # saved at step 2; step 3 logged, then killed in step 4: step 3's records are superseded
    (2, 1, 2, ()),  # saved at step 2, killed in step 3, with 3P groups (a whole epoch) queued or in flight
    (2, 1, 2, STREAMED),  # the same with every call of the window in the rollout worker's one engine loop at once
])
def test_killed_async_run_resumes_every_prompt_once(tmp_path, ray_local, k, save_every, kill_after, extra):
    args = (f"trainer.max_staleness={k}", f"trainer.save_every={save_every}", *extra)
    _all_steps(train_run(CONFIG, tmp_path / "straight", *COMMON, *args))
    straight = trained_prompts(tmp_path / "straight")

    out = tmp_path / "run"
    _killed_mid_step(out, kill_after, *args)
    saved = max(int(p.name[5:]) for p in (out / "checkpoints").glob("step_*"))
    assert saved == kill_after - kill_after % save_every
    pipe = torch.load(out / "checkpoints" / f"step_{saved}" / "controller.pt", weights_only=False)["sampler"]["pipeline"]
    assert len(pipe["untaken"]) == (k + 1) * P  # the whole window, none of it trained yet
    before = trained_prompts(out)
    assert sorted(before) == list(range(1, kill_after + 1))

    records = train_run(CONFIG, out, *COMMON, *args, "trainer.resume=auto")
    _all_steps(records)
    assert [r["supersedes_after"] for r in records if r.get("event") == "resumed"] == [saved]
    got = trained_prompts(out)

    # The strongest claim: the same prompts in the same steps, in the same order, as the uninterrupted run.
    assert got == straight
    assert sorted(got) == list(range(1, TOTAL + 1)) and all(len(p) == P for p in got.values())
    # Each epoch's prompts trained exactly once (a multiset: nothing twice, nothing left out).
    for epoch in range(TOTAL * P // EPOCH):
        steps = range(epoch * EPOCH // P + 1, (epoch + 1) * EPOCH // P + 1)
        trained = Counter(u for s in steps for u in got[s])
        assert len(trained) == EPOCH and set(trained.values()) == {1}, (epoch, trained)
    # The steps the killed run had logged before its checkpoint stand; the rest were trained again.
    assert {s: got[s] for s in range(1, saved + 1)} == {s: before[s] for s in range(1, saved + 1)}


def _all_steps(records: list[dict]) -> None:
    assert sorted({r["step"] for r in records if "train/reward_mean" in r}) == list(range(1, TOTAL + 1))
