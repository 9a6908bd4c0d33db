"""A run that starts again at step 0 over records already in its metrics.jsonl (a supervisor recovery with no
checkpoint yet, or `trainer.resume=auto` finding none after a sweep's restart event) marks it with a `resumed`
event, `supersedes_after: 0`, as a resume from a checkpoint does with its step: every step written again is marked
as replacing the earlier record. A run in a fresh directory writes no such marker. In-process, local backend."""
import json
from pathlib import Path

import pytest

from fleetrl.cluster.group import WorkerLostError
from fleetrl.config import load_config
from fleetrl.trainer import supervisor
from fleetrl.trainer.run import plan_for, run_plan
from fleetrl.trainer.trainer import Trainer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
TINY = ("model.path=tiny:", "cluster.backend=local", "data.prompts_per_step=2", "rollout.n=2",
        "algorithm.micro_batch_size=4", "trainer.val_every=0", "trainer.val_before_train=false",
        "tracking.progress=false", "tracking.console=false", "tracking.tensorboard=false", "trainer.total_steps=2",
        "trainer.save_every=0")


def _run(out: Path, *overrides: str) -> list[dict]:
    run_plan(plan_for(load_config("examples/quickstart.yaml", [*TINY, *overrides, f"trainer.output_dir={out}"])))
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _events(records: list[dict]) -> list[tuple[int, str, int | None]]:
    return [(r["step"], r["event"], r.get("supersedes_after")) for r in records if "event" in r]


def test_a_recovery_without_a_checkpoint_marks_its_restart_from_step_0(tmp_path, monkeypatch):
    # Step 2's first attempt loses a worker; no checkpoint exists yet (save_every=0), so the rebuilt run starts
    # at step 0 and writes step 1 again.
    calls = {"n": 0}
    real = Trainer.run_step

    def lose_a_worker_once(self):  # noqa: ANN001, ANN202
        calls["n"] += 1
        if calls["n"] == 2:
            raise WorkerLostError("pool 'main': a worker died")
        return real(self)
    monkeypatch.setattr(Trainer, "run_step", lose_a_worker_once)
    monkeypatch.setattr(supervisor, "wait_for_capacity", lambda plan, timeout_s: None)
    records = _run(tmp_path / "run", "trainer.max_restarts=1")
    assert _events(records) == [(1, "restart", None), (0, "resumed", 0), (2, "finished", None)]
    assert [r["step"] for r in records if "event" not in r] == [1, 1, 2]
    assert next(r for r in records if r.get("event") == "resumed")["path"] is None  # no checkpoint: from scratch


def test_auto_resume_with_no_checkpoint_after_a_restart_event_marks_step_0(tmp_path):
    # What `fleetrl sweep` leaves before it retries a run that saved no checkpoint.
    out = tmp_path / "run"
    out.mkdir()
    earlier = [{"step": 1, "train/reward_mean": 0.5}, {"step": 1, "event": "restart", "source": "sweep"}]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in earlier))
    records = _run(out, "trainer.resume=auto")
    assert _events(records) == [(1, "restart", None), (0, "resumed", 0), (2, "finished", None)]


def test_a_fresh_run_writes_no_marker(tmp_path):
    assert _events(_run(tmp_path / "run", "trainer.resume=auto")) == [(2, "finished", None)]
