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
