"""What `trainer.resume` and `fleetrl export` say about a path that is no checkpoint, a checkpoint of another model,
a truncated shard and a bad --dtype: a CheckpointError naming the path and what to pass instead."""
import json
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from fleetrl.checkpoint.export import CheckpointError, export_hf, write_hf_folder
from fleetrl.checkpoint.integrity import file_checksums, validate_checkpoint
from fleetrl.checkpoint.manager import find_resume, load_checkpoint
from fleetrl.config import load_config, write_config
from fleetrl.models.hf import load_causal_lm, load_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _checkpoint(step_dir: Path, model_path: str = "tiny:", *, weights: bool = False) -> Path:
    """A complete checkpoint as the manager writes it: files, checksums.json, meta.json last."""
    step_dir.mkdir(parents=True)
    if weights:
        dcp.save({"model": load_causal_lm(model_path).state_dict()}, checkpoint_id=str(step_dir / "actor"))
    (step_dir / "checksums.json").write_text(json.dumps(file_checksums(step_dir)))
    meta = {"step": int(step_dir.name[5:]), "model_path": model_path, "tokenizer_path": "tiny:",
            "dtype": "float32", "checksums": "checksums.json"}
    (step_dir / "meta.json").write_text(json.dumps(meta))
    return step_dir


def test_run_directory_as_resume_path_says_what_to_pass(tmp_path):
    run = tmp_path / "run"
    _checkpoint(run / "checkpoints" / "step_2")
    (run / "metrics.jsonl").write_text("")
    with pytest.raises(CheckpointError, match=r"is a run directory, not a checkpoint: pass one of its step "
                                              r"directories, e.g. .*/run/checkpoints/step_2 \(the latest\); or "
                                              r"resume its newest checkpoint with trainer.resume=auto "
                                              r"trainer.output_dir=.*/run$"):
        find_resume(None, str(run))
    with pytest.raises(CheckpointError, match=r"is a run directory.*step_2"):  # its checkpoints/ folder, too
        find_resume(None, str(run / "checkpoints"))


def test_missing_resume_path_does_not_exist(tmp_path):
    with pytest.raises(CheckpointError, match=r"trainer.resume=.*/gone: does not exist$"):
        find_resume(None, str(tmp_path / "gone"))
    assert validate_checkpoint(tmp_path / "gone") == "does not exist"


def test_interrupted_save_is_still_called_incomplete(tmp_path):
    (tmp_path / "step_3").mkdir()
    assert validate_checkpoint(tmp_path / "step_3") == "incomplete (no meta.json; the save was interrupted)"


def test_auto_without_an_output_dir_finds_nothing():
    assert find_resume(None, "auto") is None


class _Group:
    """A worker group whose load raises what a worker raised (Ray wraps it; its text carries the worker's)."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def call_all(self, method, *args):  # noqa: ANN001, ANN201
        raise self.error


def _loadable(step_dir: Path, model_path: str) -> Path:
    ckpt = _checkpoint(step_dir, model_path)
    torch.save({}, ckpt / "controller.pt")
    (ckpt / "config.yaml").write_text("trainer: {seed: 0}\n")
    return ckpt


def test_a_shape_that_does_not_fit_names_both_models(tmp_path):
    ckpt = _loadable(tmp_path / "step_2", "tiny:hidden=128")
    cfg = load_config("examples/ppo_tiny.yaml", ["model.path=tiny:hidden=32"])
    mismatch = RuntimeError("worker rank 0: ValueError: Size mismatch between saved torch.Size([52, 128]) and "
                            "current torch.Size([52, 32]) for model.embed_tokens.weight")
    with pytest.raises(CheckpointError, match=r"trained from model 'tiny:hidden=128' \(model_path in its meta.json\), "
                                              r"whose weights do not fit this run's model.path='tiny:hidden=32'") as err:
        load_checkpoint(ckpt, groups=[_Group(mismatch)], state={}, config=cfg)
    assert err.value.__cause__ is mismatch


def test_other_load_failures_are_not_called_another_model(tmp_path):
    ckpt = _loadable(tmp_path / "step_2", "tiny:")
    cfg = load_config("examples/ppo_tiny.yaml", [])
    with pytest.raises(OSError, match="disk gone"):
        load_checkpoint(ckpt, groups=[_Group(OSError("disk gone"))], state={}, config=cfg)


def test_the_same_model_at_another_path_is_not_refused(tmp_path):
    # A job's uploaded working dir, another mount: the name differs, the shapes fit. Nothing compares names.
    ckpt = _loadable(tmp_path / "step_2", "/old/mount/models/base")
    cfg = load_config("examples/ppo_tiny.yaml", ["model.path=tiny:"])
    assert find_resume(None, str(ckpt)) == ckpt
    assert load_checkpoint(ckpt, groups=[], state={}, config=cfg) is not None


def test_export_of_a_truncated_shard_is_a_checkpoint_error(tmp_path):
    ckpt = _checkpoint(tmp_path / "checkpoints" / "step_1", weights=True)
    shard = min((ckpt / "actor").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=rf"cannot export checkpoint .*step_1': actor/{shard.name} has 100 "
                                              r"bytes, \d+ were saved \(truncated or replaced\)"):
        export_hf(ckpt, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_export_checks_the_actor_of_a_checkpoint_without_checksums(tmp_path):
    ckpt = _checkpoint(tmp_path / "checkpoints" / "step_1", weights=True)
    (ckpt / "checksums.json").unlink()  # as older versions saved it (and with no controller.pt: export needs none)
    meta = json.loads((ckpt / "meta.json").read_text())
    del meta["checksums"]
    (ckpt / "meta.json").write_text(json.dumps(meta))
    shard = min((ckpt / "actor").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=rf"actor/{shard.name} is truncated \(100 < \d+ bytes\)"):
        export_hf(ckpt, tmp_path / "hf")


def test_export_bad_dtype_names_the_flag(tmp_path):
    ckpt = _checkpoint(tmp_path / "checkpoints" / "step_1", weights=True)
    with pytest.raises(CheckpointError, match=r"--dtype 'fp8' is not supported for export; expected one of \["):
        export_hf(ckpt, tmp_path / "hf", dtype="fp8")
    with pytest.raises(CheckpointError, match=r"--dtype 'fp8'"):
        write_hf_folder(load_causal_lm("tiny:"), load_tokenizer("tiny:"), tmp_path / "hf", dtype="fp8")


def test_export_of_a_missing_path_does_not_exist(tmp_path):
    with pytest.raises(CheckpointError, match=r"checkpoint '.*/nope' does not exist \(resolved to"):
        export_hf(tmp_path / "nope", tmp_path / "hf")


def test_a_broken_checkpoint_is_reported_once(tmp_path, caplog):
    # `fleetrl train` looks for its resume point twice (run.py's early check, then the Trainer's load): the same
    # broken step_2 must be warned about once, not once per look.
    _loadable(tmp_path / "checkpoints" / "step_1", "tiny:")
    (tmp_path / "checkpoints" / "step_2").mkdir()  # an interrupted save: no meta.json
    with caplog.at_level(logging.WARNING, logger="fleetrl.checkpoint"):
        found = [find_resume(tmp_path, "auto") for _ in range(2)]
    assert found == [tmp_path / "checkpoints" / "step_1"] * 2
    skipped = [r.getMessage() for r in caplog.records if "skipping checkpoint" in r.getMessage()]
    assert skipped == [f"skipping checkpoint {tmp_path / 'checkpoints' / 'step_2'}: incomplete (no meta.json; the save "
                       f"was interrupted)"]


def test_run_control_keys_are_not_a_config_change_on_resume(tmp_path):
    ckpt = _loadable(tmp_path / "step_2", "tiny:")
    write_config(ckpt / "config.yaml", load_config("examples/ppo_tiny.yaml", ["trainer.output_dir=/runs/a"]))
    # Where the run writes, how it resumes, what it saves and prints: none of it changes what is trained.
    control = ["trainer.output_dir=/runs/b", "trainer.resume=auto", "trainer.name=again", "trainer.save_every=7",
               "trainer.keep_last=1", "trainer.max_restarts=2", "tracking.progress=false", "tracking.console=false"]
    cfg = load_config("examples/ppo_tiny.yaml", control)
    assert load_checkpoint(ckpt, groups=[], state={}, config=cfg) == ""
    # A change to what is trained still shows, and only it (the run-control keys stay out of the diff).
    changed = load_config("examples/ppo_tiny.yaml", [*control, "trainer.total_steps=99"])
    diff = load_checkpoint(ckpt, groups=[], state={}, config=changed)
    assert [line for line in diff.splitlines() if line[0] in "+-"] == ["-  total_steps: 160", "+  total_steps: 99"]
