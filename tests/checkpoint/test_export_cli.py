"""End to end: a real training checkpoint -> `fleetrl export --hf` (directly and from deltas) -> a folder that
AutoModelForCausalLM loads and that gives the trained model's logits."""
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fleetrl.checkpoint.export import load_actor_model
from tests.integration.helpers import train_run

pytestmark = pytest.mark.slow  # each test trains and/or runs the `fleetrl export` CLI in a subprocess

ARGS = ("model.path=tiny:", "cluster.backend=local", "trainer.total_steps=4", "trainer.save_every=2",
        "trainer.keep_last=0", "trainer.delta_checkpoints=exact", "data.prompts_per_step=8", "data.val=null",
        "actor.optim.lr=0.01")


def _export(*args):
    return subprocess.run([sys.executable, "-m", "fleetrl.cli.main", "export", *args], capture_output=True,
                          text=True, timeout=300)


def test_export_round_trip(tmp_path):
    train_run("examples/quickstart.yaml", tmp_path / "run", *ARGS)
    ckpt = tmp_path / "run" / "checkpoints" / "step_4"
    trained, _ = load_actor_model(ckpt)
    ids = torch.tensor([[3, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        want = trained(ids).logits
    for extra in ([], ["--from-deltas"]):
        out = tmp_path / f"hf{len(extra)}"
        r = _export(str(ckpt), "--hf", str(out), *extra)
        assert r.returncode == 0, r.stdout + r.stderr
        model = AutoModelForCausalLM.from_pretrained(out)
        tok = AutoTokenizer.from_pretrained(out)
        assert tok("copy 7 =")["input_ids"]
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, want, atol=1e-6, rtol=0)


def test_export_missing_checkpoint_is_clear(tmp_path):
    r = _export(str(tmp_path / "nope"), "--hf", str(tmp_path / "o"))
    assert r.returncode == 2 and "nope' does not exist" in (r.stdout + r.stderr)


def test_export_from_deltas_without_deltas_is_one_line(tmp_path):
    args = [a for a in ARGS if not a.startswith("trainer.delta_checkpoints")] + ["trainer.total_steps=2"]
    train_run("examples/quickstart.yaml", tmp_path / "run", *args)
    r = _export(str(tmp_path / "run" / "checkpoints" / "step_2"), "--hf", str(tmp_path / "o"), "--from-deltas")
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and "has no delta.safetensors" in lines[0], lines
