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
