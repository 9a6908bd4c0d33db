"""A fresh machine, first try: with trainer.save_every=0 (the default) the quickstart still leaves a checkpoint of
its last step, which `fleetrl export` turns into a Hugging Face folder; Ctrl-C (SIGINT to the whole process group,
as a terminal sends it) checkpoints the last complete step, and trainer.resume=auto continues from it to the end."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from fleetrl.checkpoint.export import load_actor_model
from fleetrl.cli.main import app
from tests.integration.helpers import read_metrics, train_run

pytestmark = pytest.mark.slow  # Ray, and a `fleetrl train` subprocess
QUICKSTART = "examples/quickstart.yaml"
SMALL = ("data.prompts_per_step=8", "trainer.val_every=0", "trainer.val_before_train=false",
         "algorithm.micro_batch_size=16", "trainer.save_every=0")


def _train_steps(records: list[dict]) -> list[int]:
    return [r["step"] for r in records if "train/reward_mean" in r]


def test_quickstart_leaves_its_last_step_and_it_exports(tmp_path, ray_local):
    out = tmp_path / "run"
    train_run(QUICKSTART, out, "trainer.total_steps=3", "trainer.save_every=0")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_3"]
    ckpt = out / "checkpoints" / "step_3"
    result = CliRunner().invoke(app, ["export", str(ckpt), "--hf", str(tmp_path / "hf")])
    assert result.exit_code == 0, result.output
    trained, _ = load_actor_model(ckpt)
    ids = torch.tensor([[3, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(tmp_path / "hf")(ids).logits,
                                   trained(ids).logits, atol=1e-6, rtol=0)


def test_ctrl_c_checkpoints_the_last_complete_step_and_auto_resumes_to_the_end(tmp_path, ray_local):
    out, total = tmp_path / "run", 10
    proc = subprocess.Popen([sys.executable, "-m", "fleetrl.cli.main", "train", QUICKSTART, *SMALL,
                             f"trainer.total_steps={total}", "tracking.progress=false", f"trainer.output_dir={out}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    metrics = out / "metrics.jsonl"
    while proc.poll() is None and not (metrics.exists() and '"step": 2,' in metrics.read_text()):
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the whole foreground group: Ray's processes too
    text, _ = proc.communicate(timeout=180)
    assert proc.returncode == 128 + signal.SIGINT, text
    records = read_metrics(out)
    stopped = [r for r in records if r.get("event") == "stopped"]
    assert len(stopped) == 1 and stopped[0]["signal"] == signal.SIGINT, records
    k = stopped[0]["step"]
    assert 2 <= k < total and _train_steps(records) == list(range(1, k + 1)), (k, text)
    assert f"last complete checkpoint: step {k}; continue with:" in text and "trainer.resume=auto" in text
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == [f"step_{k}"]  # save_every=0

    records = train_run(QUICKSTART, out, *SMALL, f"trainer.total_steps={total}", "trainer.resume=auto")
    resumed = [i for i, r in enumerate(records) if r.get("event") == "resumed"]
    assert len(resumed) == 1 and records[resumed[0]]["step"] == k and records[resumed[0]]["supersedes_after"] == k
    assert _train_steps(records[resumed[0]:]) == list(range(k + 1, total + 1))
    assert records[-1]["event"] == "finished"
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == sorted([f"step_{k}", f"step_{total}"])
