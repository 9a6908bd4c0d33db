"""Checkpoint checksums: same-size corruption inside a .distcp is found, `resume=auto` falls back to the newest
intact checkpoint, and all-corrupt is an error rather than a silent fresh start."""
import hashlib
import json
import logging
import shutil

import pytest

from fleetrl.checkpoint.integrity import file_checksums, sha256_file, validate_checkpoint
from fleetrl.checkpoint.manager import CheckpointError, find_resume, load_checkpoint
from fleetrl.config import load_config
from fleetrl.errors import UserError
from tests.integration.helpers import train_run

# Two tiny steps in-process (no Ray), a checkpoint after each.
RUN = ("model.path=tiny:", "cluster.backend=local", "data.prompts_per_step=2", "rollout.n=2",
       "algorithm.mini_batch_prompts=2", "algorithm.micro_batch_size=4", "trainer.total_steps=2",
       "trainer.save_every=1", "trainer.keep_last=0", "trainer.val_every=0", "rewards.remote_token=s3cret-tok")


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "run"
    train_run("examples/ppo_tiny.yaml", out, *RUN)
    return out


@pytest.fixture
def run(saved_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(saved_run, out)
    return out


def _flip_middle_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_sha256_by_hand(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"abc")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.bin").write_bytes(b"")
    (tmp_path / "meta.json").write_text("{}")  # the completeness mark is never in its own manifest
    # sha256("abc") and sha256("") are the FIPS 180-2 test vectors
    abc = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    empty = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    assert sha256_file(tmp_path / "a.bin") == abc
    assert file_checksums(tmp_path) == {"algo": "sha256", "files": {"a.bin": {"size": 3, "sha256": abc},
                                                                    "sub/b.bin": {"size": 0, "sha256": empty}}}


def test_sha256_streams_files_larger_than_a_chunk(tmp_path):
    data = bytes(range(256)) * (5 * 2**20 // 256 + 3)  # > one 4 MiB chunk, not a multiple of it
    (tmp_path / "big").write_bytes(data)
    assert sha256_file(tmp_path / "big") == hashlib.sha256(data).hexdigest()


def test_saved_checkpoint_lists_every_file(run):
    ckpt = run / "checkpoints" / "step_2"
    meta = json.loads((ckpt / "meta.json").read_text())
    listed = json.loads((ckpt / meta["checksums"]).read_text())["files"]
    on_disk = {p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file()}
    assert set(listed) == on_disk - {"meta.json", "checksums.json"}
    assert any(k.endswith(".distcp") for k in listed) and "controller.pt" in listed
    assert validate_checkpoint(ckpt) is None


def test_same_size_corruption_falls_back_to_the_older_checkpoint(run, caplog):
    distcp = min((run / "checkpoints" / "step_2" / "actor").glob("*.distcp"))
    size = distcp.stat().st_size
    _flip_middle_byte(distcp)
    assert distcp.stat().st_size == size
    assert "is corrupt (sha256" in validate_checkpoint(run / "checkpoints" / "step_2")
    with caplog.at_level(logging.WARNING, logger="fleetrl.checkpoint"):
        assert find_resume(run, "auto") == run / "checkpoints" / "step_1"
    assert "skipping checkpoint" in caplog.text and distcp.name in caplog.text


def test_every_checkpoint_corrupt_is_an_error_not_a_fresh_start(run):
    for step in (1, 2):
        _flip_middle_byte(min((run / "checkpoints" / f"step_{step}" / "actor").glob("*.distcp")))
    with pytest.raises(CheckpointError, match=r"none of the 2 checkpoints .*\(step_2: actor/.*corrupt.*; "
                                              r"step_1: actor/.*corrupt.*new trainer.output_dir") as err:
        find_resume(run, "auto")
    assert isinstance(err.value, UserError)


def test_missing_and_truncated_files_are_named(run):
    ckpt = run / "checkpoints" / "step_2"
    (ckpt / "controller.pt").unlink()
    assert validate_checkpoint(ckpt) == "controller.pt is missing (checksums.json lists it)"
    shutil.copy(run / "checkpoints" / "step_1" / "controller.pt", ckpt / "controller.pt")
    worker = min((ckpt / "workers").glob("*.pt"))
    worker.write_bytes(worker.read_bytes()[:-1])
    assert "bytes, " in validate_checkpoint(ckpt) and "truncated" in validate_checkpoint(ckpt)


def test_checkpoint_without_checksums_uses_the_size_checks(run):
    ckpt = run / "checkpoints" / "step_2"
    meta = json.loads((ckpt / "meta.json").read_text())
    del meta["checksums"]
    (ckpt / "meta.json").write_text(json.dumps(meta))
    (ckpt / "checksums.json").unlink()
    assert validate_checkpoint(ckpt) is None  # an old-style checkpoint is still accepted
    distcp = min((ckpt / "actor").glob("*.distcp"))
    distcp.write_bytes(distcp.read_bytes()[:10])
    assert "is truncated" in validate_checkpoint(ckpt)


def test_no_checkpoints_at_all_is_a_fresh_start(tmp_path):
    assert find_resume(tmp_path, "auto") is None


def test_checkpoint_config_is_redacted_private_and_not_a_diff(run, saved_run):
    ckpt = run / "checkpoints" / "step_2"
    text = (ckpt / "config.yaml").read_text()
    assert "s3cret-tok" not in text and "remote_token: '***'" in text
    assert (ckpt / "config.yaml").stat().st_mode & 0o777 == 0o600
    same = load_config("examples/ppo_tiny.yaml", [*RUN, "tracking.progress=false", "tracking.console=false",
                                                  f"trainer.output_dir={saved_run}", "rewards.remote_token=other"])
    assert load_checkpoint(ckpt, groups=[], state={}, config=same) == ""  # a token change is not reported
    (ckpt / "config.yaml").write_text(text.replace("'***'", "s3cret-tok"))  # as older versions wrote it
    changed = load_config("examples/ppo_tiny.yaml", [*RUN, "tracking.progress=false", "tracking.console=false",
                                                     f"trainer.output_dir={saved_run}", "trainer.total_steps=3"])
    diff = load_checkpoint(ckpt, groups=[], state={}, config=changed)
    assert "total_steps: 3" in diff and "s3cret" not in diff


def test_training_resumes_from_the_intact_checkpoint(run):
    _flip_middle_byte(min((run / "checkpoints" / "step_2" / "actor").glob("*.distcp")))
    records = train_run("examples/ppo_tiny.yaml", run, *RUN, "trainer.total_steps=3", "trainer.resume=auto")
    assert [r["step"] for r in records if r.get("event") == "resumed"] == [1]
    assert (run / "checkpoints" / "step_3" / "checksums.json").is_file()
