"""A checkpoint save that runs out of disk: one `error:` line (which directory, that the disk is full, its free bytes,
the newest safe checkpoint, how to fix), no half-written step directory, and resume=auto continues from the last
complete checkpoint. Tiny in-process runs on the local backend; the low-level writer is made to fail at step 2."""
import errno
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import typer

from fleetrl.checkpoint import manager
from fleetrl.cli import main as cli_main
from fleetrl.config import load_config
from fleetrl.trainer.run import plan_for, run_plan

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
TINY = ["model.path=tiny:", "cluster.backend=local", "data.prompts_per_step=2", "rollout.n=2",
        "algorithm.micro_batch_size=4", "trainer.val_every=0", "trainer.val_before_train=false",
        "tracking.progress=false", "tracking.console=false", "tracking.tensorboard=false", "trainer.keep_last=0",
        "trainer.total_steps=2", "trainer.save_every=1"]
FREE = 12345  # what the patched shutil.disk_usage reports
# The two ways a full disk surfaces: the OS's ENOSPC, and torch's zip writer losing track of a short write.
FAILURES = [OSError(errno.ENOSPC, "No space left on device"),
            RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")]


def _fail_step_2(monkeypatch: pytest.MonkeyPatch, failure: BaseException) -> None:
    """torch.save (workers' extras and controller.pt) raises `failure` while writing step 2; step 1 saves normally."""
    real = torch.save

    def save(obj: Any, f: Any, *a: Any, **kw: Any) -> None:
        if "step_2" in str(f):
            raise failure
        real(obj, f, *a, **kw)
    monkeypatch.setattr(torch, "save", save)
    real_usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real_usage(p)._replace(free=FREE))


@pytest.mark.parametrize("failure", FAILURES, ids=["enospc", "inline_container"])
def test_disk_full_on_save_is_one_error_line_and_resume_continues(tmp_path, monkeypatch, capsys, failure):
    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    _fail_step_2(monkeypatch, failure)
    with pytest.raises(typer.Exit) as ended:
        cli_main.train("examples/quickstart.yaml", [*TINY, f"trainer.output_dir={out}"])
    assert ended.value.exit_code == 2
    said = capsys.readouterr().err
    err = [line for line in said.splitlines() if line.startswith("error: ")]
    assert len(err) == 1 and "Traceback" not in said, said
    line = err[0]
    assert str(ckpts) in line and "disk is full" in line and f"{FREE} bytes free" in line
    assert f"newest complete checkpoint is {ckpts / 'step_1'}" in line
    assert "trainer.output_dir" in line and "trainer.keep_last" in line
    # Nothing half-written is left for a resume (or the disk) to carry: only step_1 and its `latest` pointer.
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_1"]
    assert (ckpts / "latest").read_text().strip() == "step_1"

    monkeypatch.undo()
    run_plan(plan_for(load_config("examples/quickstart.yaml",
                                  [*TINY, f"trainer.output_dir={out}", "trainer.resume=auto"])))
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    resumed = [r for r in records if r.get("event") == "resumed"]
    assert [(r["step"], Path(r["path"]).name) for r in resumed] == [(1, "step_1")]
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_1", "step_2"]


def test_a_save_failing_otherwise_keeps_its_error(tmp_path, monkeypatch):
    # Only a full disk is re-worded: any other failure of a save is a bug and keeps its own type and text.
    _fail_step_2(monkeypatch, RuntimeError("something else broke"))
    with pytest.raises(RuntimeError, match="something else broke"):
        run_plan(plan_for(load_config("examples/quickstart.yaml", [*TINY, f"trainer.output_dir={tmp_path / 'r'}"])))
    assert not list((tmp_path / "r" / "checkpoints").glob("*.tmp"))
    assert manager.is_disk_full(RuntimeError("something else broke")) is False
