"""A run that fails to start leaves no run directory behind (or one that can be used again); model names are
checked under their config key before anything is created; `resume=auto` without trainer.output_dir says it
cannot resume, and with no checkpoint to resume refuses to append a second run to an existing metrics.jsonl; a
refused resume leaves the run's config.yaml as it was."""
import json
import shutil
import sys
from pathlib import Path

import pytest

from fleetrl.checkpoint.manager import CheckpointError
from fleetrl.config import load_config
from fleetrl.models.hf import ModelPathError
from fleetrl.trainer import run as run_mod
from fleetrl.trainer.run import check_models, plan_for, run_plan
from fleetrl.trainer.rundir import RunDirError, claim_run_dir
from fleetrl.trainer.supervisor import Supervisor
from tests.integration.helpers import train_run

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
CONFIG = str(Path(__file__).resolve().parents[2] / "examples" / "ppo_tiny.yaml")  # absolute: tests chdir
TINY = ("model.path=tiny:", "cluster.backend=local", "data.prompts_per_step=2", "rollout.n=2",
        "algorithm.mini_batch_prompts=2", "algorithm.micro_batch_size=4", "trainer.total_steps=1",
        "trainer.val_every=0", "tracking.progress=false", "tracking.console=false", "tracking.tensorboard=false")


def _cfg(*overrides: str):
    return load_config(CONFIG, [*TINY, *overrides])


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("saved") / "run"
    train_run(CONFIG, out, *TINY, "trainer.save_every=1")
    return out


def _fail_at_start(monkeypatch) -> None:
    def boom(self):
        raise RuntimeError("worker failed to start")
    monkeypatch.setattr(Supervisor, "run", boom)


def test_failing_resume_creates_no_directory(tmp_path, saved_run):
    out = tmp_path / "new"
    cfg = _cfg(f"trainer.output_dir={out}", f"trainer.resume={saved_run}")  # the run dir, not a step dir
    with pytest.raises(CheckpointError, match=r"is a run directory, not a checkpoint"):
        run_plan(plan_for(cfg))
    assert not out.exists()


def test_resume_with_another_model_creates_no_directory(tmp_path, saved_run):
    out = tmp_path / "new"
    ckpt = saved_run / "checkpoints" / "step_1"
    cfg = _cfg(f"trainer.output_dir={out}", f"trainer.resume={ckpt}", "model.path=tiny:hidden=32,heads=2")
    with pytest.raises(CheckpointError, match=r"trained from model 'tiny:'.*model.path='tiny:hidden=32,heads=2'"):
        run_plan(plan_for(cfg))
    assert not out.exists()


def test_start_up_failure_removes_the_directory_it_created(tmp_path, monkeypatch):
    _fail_at_start(monkeypatch)
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="worker failed to start"):
        run_plan(plan_for(_cfg(f"trainer.output_dir={out}")))
    assert not out.exists()
    monkeypatch.chdir(tmp_path)  # the same without trainer.output_dir: no empty runs/NAME-STAMP left
    with pytest.raises(RuntimeError, match="worker failed to start"):
        run_plan(plan_for(_cfg()))
    assert list((tmp_path / "runs").iterdir()) == []


def test_start_up_failure_leaves_an_existing_directory_reusable(tmp_path, monkeypatch):
    out = tmp_path / "mine"
    (out / "notes.txt").parent.mkdir()
    (out / "notes.txt").write_text("kept")
    _fail_at_start(monkeypatch)
    with pytest.raises(RuntimeError, match="worker failed to start"):
        run_plan(plan_for(_cfg(f"trainer.output_dir={out}")))
    assert (out / "notes.txt").read_text() == "kept"  # not created by the run: never removed
    claim_run_dir(_cfg(f"trainer.output_dir={out}")).release(failed=False)  # no "already holds a run"


def test_a_directory_with_metrics_still_holds_a_run(saved_run):
    with pytest.raises(RunDirError, match="already holds a run"):
        claim_run_dir(_cfg(f"trainer.output_dir={saved_run}"))


def test_release_after_failure_keeps_a_directory_with_checkpoints(tmp_path):
    out = tmp_path / "run"
    run_dir = claim_run_dir(_cfg(f"trainer.output_dir={out}"))
    assert run_dir.created
    (out / "checkpoints" / "step_1").mkdir(parents=True)
    run_dir.release(failed=True)
    assert (out / "checkpoints" / "step_1").is_dir()


@pytest.mark.parametrize("override, key", [
    ("model.path=/tmp/fleetrl-no-such-model", r"model\.path='/tmp/fleetrl-no-such-model' does not exist"),
    ("model.tokenizer=/tmp/fleetrl-no-such-tok", r"model\.tokenizer='/tmp/fleetrl-no-such-tok' does not exist"),
    ("model.path=tiny:hidden=abc", r"model\.path='tiny:hidden=abc': hidden='abc' is not a int"),
    ("rewards.model={path: /tmp/fleetrl-no-rm}", r"rewards\.model\.path='/tmp/fleetrl-no-rm' does not exist"),
])
def test_model_names_are_checked_under_their_key(override, key):
    with pytest.raises(ModelPathError, match=key):
        check_models(_cfg(override))


def test_bad_model_path_creates_no_directory(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(ModelPathError, match=r"model\.path="):
        run_mod.train(CONFIG, [*TINY, "model.path=gguf:/tmp/fleetrl-missing.gguf",
                                                 f"trainer.output_dir={out}"])
    assert not out.exists()


def test_auto_resume_without_output_dir_says_it_cannot_resume(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(Supervisor, "run", lambda self: {})
    monkeypatch.chdir(tmp_path)
    run_plan(plan_for(_cfg("trainer.resume=auto")))
    out = capsys.readouterr().out
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert out.count("trainer.resume=auto found nothing to resume") == 1
    assert f"trainer.output_dir is unset, so this run got the new directory runs/{run_dir.name}" in out


def test_a_failed_start_keeps_the_stall_dumps_its_error_points_to(tmp_path):
    cfg = _cfg(f"trainer.output_dir={tmp_path / 'run'}")
    run_dir = claim_run_dir(cfg)
    (run_dir.path / "metrics.jsonl").touch()
    (run_dir.path / "stalls" / "step_0").mkdir(parents=True)
    (run_dir.path / "stalls" / "step_0" / "rollout_r0.txt").write_text("Thread 1 ...")
    run_dir.release(failed=True)
    assert (run_dir.path / "stalls" / "step_0" / "rollout_r0.txt").is_file()


def _metrics(out: Path, *records: dict) -> str:
    out.mkdir(parents=True)
    text = "".join(json.dumps(r) + "\n" for r in records)
    (out / "metrics.jsonl").write_text(text)
    return text


def test_auto_resume_with_no_checkpoint_refuses_to_append_a_second_run(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from fleetrl.cli.main import app

    out = tmp_path / "run"
    before = _metrics(out, {"step": 1, "train/reward_mean": 0.5}, {"step": 2, "train/reward_mean": 0.25})
    monkeypatch.setattr(run_mod, "_run_in", lambda *a: pytest.fail("the run started"))
    result = CliRunner().invoke(app, ["train", CONFIG, *TINY, f"trainer.output_dir={out}", "trainer.resume=auto"])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0].startswith(f"error: trainer.resume=auto: {out} holds a run (metrics.jsonl up to step 2) but no "
                               f"complete checkpoint")
    assert "pass a new trainer.output_dir" in lines[0] and f"delete {out}" in lines[0]
    assert (out / "metrics.jsonl").read_text() == before and sorted(p.name for p in out.iterdir()) == ["metrics.jsonl"]
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


def test_auto_resume_into_a_new_directory_says_it_starts_at_step_0(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(Supervisor, "run", lambda self: {})
    out = tmp_path / "new"
    run_plan(plan_for(_cfg(f"trainer.output_dir={out}", "trainer.resume=auto")))
    said = capsys.readouterr().out
    assert said.count("trainer.resume=auto found no checkpoint") == 1
    assert f"trainer.resume=auto found no checkpoint in {out}: starting a new run at step 0" in said


def test_auto_resume_after_a_restart_event_starts_again(tmp_path, monkeypatch, capsys):
    # What `fleetrl sweep` does before it retries a run that left no checkpoint: the restart event marks where the
    # repeated steps begin, so this second run is not mixed in silently.
    monkeypatch.setattr(Supervisor, "run", lambda self: {})
    out = tmp_path / "run"
    _metrics(out, {"step": 2, "train/reward_mean": 0.5}, {"step": 2, "event": "restart", "source": "sweep"})
    run_plan(plan_for(_cfg(f"trainer.output_dir={out}", "trainer.resume=auto")))
    assert f"found no checkpoint in {out}: starting again at step 0 after the restart event" in capsys.readouterr().out


def test_a_refused_resume_leaves_config_yaml_unchanged(tmp_path, saved_run):
    out = tmp_path / "run"
    shutil.copytree(saved_run, out)
    config, metrics = (out / "config.yaml").read_bytes(), (out / "metrics.jsonl").read_bytes()
    cfg = _cfg(f"trainer.output_dir={out}", "trainer.resume=auto", "model.path=tiny:hidden=32,heads=2",
               "trainer.total_steps=2")
    with pytest.raises(CheckpointError, match=r"trained from model 'tiny:'.*model.path='tiny:hidden=32,heads=2'"):
        run_plan(plan_for(cfg))
    assert (out / "config.yaml").read_bytes() == config and (out / "metrics.jsonl").read_bytes() == metrics


def test_an_accepted_resume_writes_its_config_yaml(tmp_path, saved_run):
    out = tmp_path / "run"
    shutil.copytree(saved_run, out)
    assert "total_steps: 1\n" in (out / "config.yaml").read_text()
    records = train_run(CONFIG, out, *TINY, "trainer.total_steps=2", "trainer.resume=auto")
    assert [r["step"] for r in records if r.get("event") == "resumed"] == [1]
    assert "total_steps: 2\n" in (out / "config.yaml").read_text()
