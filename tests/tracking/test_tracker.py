import json

from fleetrl.config.schema import TrackingConfig
from fleetrl.tracking.tracker import Tracker


def test_jsonl_tensorboard_and_missing_wandb_key(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    t = Tracker(tmp_path, TrackingConfig(wandb_project="p", progress=False), {}, "run")
    t.log(1, {"train/reward_mean": 0.5, "val/reward_mean": 0.25})
    t.event(1, "restart", attempt=1)
    t.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[0] == {"step": 1, "train/reward_mean": 0.5, "val/reward_mean": 0.25}
    assert lines[1]["event"] == "restart" and lines[1]["attempt"] == 1
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    out = capsys.readouterr().out
    assert out.count("info:") == 1 and ("wandb" in out.lower())


GLOO = "[/__w/pytorch/gloo/pair.cc:553] Connection closed by peer"


def test_error_text_is_printed_literally_never_as_markup(tmp_path, capsys):
    # The supervisor logs a restart with the failure's text; Gloo errors start with "[/path]", which rich
    # would read as a closing tag and raise MarkupError inside the recovery's except block.
    t = Tracker(tmp_path, TrackingConfig(tensorboard=False, progress=False), {}, "run")
    t.event(3, "restart", attempt=1, error=f"RayTaskError: {GLOO}")
    t.event(3, GLOO)
    t.say(f"[bold]not bold[/] {GLOO}")
    t.log(4, {"val/[red]acc": 0.5})  # a metric key shown on the console (task names come from the data)
    t.close()
    out = capsys.readouterr().out
    assert out.count(GLOO) == 3  # twice from the events (kind and error), once from say
    assert "[bold]not bold[/]" in out and "[red]acc=0.5" in out
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["error"] == f"RayTaskError: {GLOO}" and lines[1]["event"] == GLOO


class _FullDisk:
    """metrics.jsonl on a disk with `room` bytes free: a write takes what fits, then ENOSPC; `room` can be raised."""

    def __init__(self, path, room: int):
        self.f, self.room = open(path, "ab", buffering=0), room

    def write(self, data: bytes) -> int:
        if self.room <= 0:
            raise OSError(28, "No space left on device")
        n = self.f.write(data[: self.room])
        self.room -= n
        return n

    def close(self) -> None:
        self.f.close()


def test_a_full_disk_never_ends_the_run_in_metrics_and_no_record_is_torn_or_lost(tmp_path, caplog):
    # A full disk is reported by the checkpoint save (DiskFullError, one line, exit 2). A metrics line written
    # first used to end the run with a bare `OSError: [Errno 28]` traceback (exit 1) instead, or at close.
    t = Tracker(tmp_path, TrackingConfig(tensorboard=False, console=False, progress=False), {}, "run")
    t.jsonl.close()
    t.jsonl = disk = _FullDisk(tmp_path / "metrics.jsonl", room=10)
    t.log(1, {"train/reward_mean": 0.5})  # 10 bytes of it fit
    t.event(1, "resumed", supersedes_after=0)
    assert "disk is full" in caplog.text
    disk.room = 10**6  # space freed
    t.log(2, {"train/reward_mean": 0.25})
    t.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r.get("event")) for r in lines] == [(1, None), (1, "resumed"), (2, None)]


def test_records_a_full_disk_still_refuses_at_close_are_reported_not_raised(tmp_path, caplog):
    t = Tracker(tmp_path, TrackingConfig(tensorboard=False, console=False, progress=False), {}, "run")
    t.jsonl.close()
    t.jsonl = _FullDisk(tmp_path / "metrics.jsonl", room=0)
    t.log(1, {"train/reward_mean": 0.5})
    t.close()
    assert "bytes of records were not written: the disk is still full" in caplog.text
