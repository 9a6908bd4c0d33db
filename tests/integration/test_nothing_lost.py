"""Nothing lost, nothing mixed (issue 18): unique run directories for runs launched together, a directory that
holds another run is refused, the last step is always checkpointed, and every user error is one line, exit code 2,
before Ray starts, with no run directory left behind."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.helpers import read_metrics, train_run

pytestmark = pytest.mark.slow  # every test runs `fleetrl train` in a subprocess (~8 s each on 2 cores)
REPO = Path(__file__).resolve().parents[2]
QUICK = (f"{REPO}/examples/quickstart.yaml", "cluster.backend=local", "trainer.total_steps=2", "data.prompts_per_step=8",
         "trainer.val_every=0", "trainer.val_before_train=false", "tracking.progress=false", "tracking.console=false")


def _train(cwd, *args, wait=True):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "fleetrl.cli.main", "train", *QUICK, *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc.communicate(timeout=240) + (proc.returncode,) if wait else proc


@pytest.mark.slow
def test_seeded_runs_launched_together_get_their_own_directories(tmp_path):
    procs = [_train(tmp_path, f"trainer.seed={k}", wait=False) for k in (1, 2, 3)]
    assert all(p.wait(timeout=240) == 0 for p in procs), [p.communicate()[0][-800:] for p in procs]
    dirs = sorted((tmp_path / "runs").iterdir())
    assert len(dirs) == 3, dirs
    for d in dirs:
        steps = [r["step"] for r in read_metrics(d) if "train/reward_mean" in r]
        assert steps == [1, 2], (d, steps)  # one run's records only, in order
    assert sorted(d.name.split("-s")[-1][0] for d in dirs) == ["1", "2", "3"]  # the seed is in the name


def test_a_directory_holding_a_run_is_refused_unless_resuming(tmp_path):
    out = tmp_path / "run"
    train_run(QUICK[0], out, *QUICK[1:])
    before = (out / "metrics.jsonl").read_text()
    text, _, rc = _train(tmp_path, f"trainer.output_dir={out}", "actor.optim.lr=0.002")
    lines = text.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), text
    assert "already holds a run" in lines[0] and "trainer.resume=auto" in lines[0] and "lr: 0.002" in lines[0]
    assert (out / "metrics.jsonl").read_text() == before


def test_the_last_step_is_checkpointed(tmp_path):
    train_run(QUICK[0], tmp_path / "run", *QUICK[1:], "trainer.total_steps=5", "trainer.save_every=3",
              "trainer.keep_last=0")
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*")) == ["step_3", "step_5"]


def test_resume_marks_superseded_records(tmp_path):
    out = tmp_path / "run"
    train_run(QUICK[0], out, *QUICK[1:], "trainer.total_steps=3", "trainer.save_every=2")
    import shutil
    shutil.rmtree(out / "checkpoints" / "step_3")  # as if the run died after logging step 3, before saving it
    records = train_run(QUICK[0], out, *QUICK[1:], "trainer.total_steps=3", "trainer.save_every=2", "trainer.resume=auto")
    resumed = [r for r in records if r.get("event") == "resumed"][-1]
    assert resumed["supersedes_after"] == 2
    assert [r["step"] for r in records if "train/reward_mean" in r] == [1, 2, 3, 3]


# Config values fail in config/plan validation, one code path: they run in-process through the same CLI
# entry point (a subprocess each would add ~8 s of torch import for nothing the subprocess cases don't show).
BAD_VALUES = [
    (("data.prompts_per_step=0",), "data.prompts_per_step must be >= 1"),
    (("trainer.save_every=-1",), "trainer.save_every must be >= 0"),
    (("actor.optim.lr=0",), "actor.optim.lr must be > 0"),
    (("actor.optim.lr=-1",), "actor.optim.lr must be > 0"),
]


@pytest.mark.parametrize("args,message", BAD_VALUES, ids=[a[0] for a, _ in BAD_VALUES])
def test_bad_value_is_one_line_exit_2_in_process(tmp_path, monkeypatch, args, message):
    from typer.testing import CliRunner

    from fleetrl.cli.main import app

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["train", *QUICK, *args])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert message in lines[0] and not (tmp_path / "runs").exists()
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


BAD = [
    (("trainer.total_steps=0",), "trainer.total_steps must be >= 1"),
    (("actor.optim.lrr=1",), "unknown config key 'actor.optim.lrr'; did you mean 'actor.optim.lr'"),
    (("data.train=/nonexistent/train.parquet",), "/nonexistent/train.parquet"),
    (("trainer.output_dir=/proc/fleetrl-cannot-write",), "cannot create the run directory /proc/fleetrl-cannot-write"),
    (("data.train=BADROWS",), "line 2 (1-based"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[a[0] for a, _ in BAD])
def test_bad_input_is_one_line_exit_2_before_ray_and_leaves_nothing(tmp_path, args, message):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"data_source": "synthetic/copy", "prompt": "copy 1 =",
                                "reward_model": {"ground_truth": "1"}}) + "\n{not json\n")
    args = tuple(a.replace("BADROWS", str(rows)) for a in args)
    t0 = time.monotonic()
    text, _, rc = _train(tmp_path, *args)
    elapsed = time.monotonic() - t0
    lines = text.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], text
    assert "Ray" not in text and not (tmp_path / "runs").exists()
    # ~8 s unloaded (interpreter + torch import); Ray start and model build would add more. Loose: CI boxes vary.
    assert elapsed < 60, elapsed
