from rich.console import Console
from typer.testing import CliRunner

from fleetrl.cli.main import app
from fleetrl.sweep.health import Heartbeat
from fleetrl.sweep.manifest import RunRecord
from fleetrl.sweep.table import StatusView, rows

runner = CliRunner()


def test_table_rows_show_progress_reward_speed_and_eta(tmp_path):
    m = tmp_path / "metrics.jsonl"
    m.write_text('{"step": 3, "train/reward_mean": 0.5, "val/reward_mean": 0.25, "train/time/step": 2.0}\n')
    beat = Heartbeat(m, total_steps=10)
    beat.poll()
    recs = [RunRecord(name="a", seed=1, grid={}, state="running", resources="cpu 0", attempts=1),
            RunRecord(name="b", seed=2, grid={})]
    # ETA = (10 - 3) steps * 2.0 s = 14 s
    assert rows(recs, {"a": beat}, {"a": 10, "b": 10}) == [
        ["a", "running", "3/10", "0.500", "0.250", "2.00", "0:00:14", "cpu 0", "1"],
        ["b", "queued", "-/10", "-", "-", "-", "-", "-", "0"],
    ]


def test_live_table_renders_on_a_terminal():
    console = Console(record=True, force_terminal=True, width=150)
    with StatusView(console, live=True) as view:
        view.update([RunRecord(name="advantage=rloo,seed=42", seed=42, grid={}, state="running")], {}, {})
    text = console.export_text()
    assert "fleetrl sweep" in text and "advantage=rloo,seed=42" in text and "ETA" in text


def test_sweep_flag_errors_exit_2_with_the_fix():
    r = runner.invoke(app, ["sweep", "examples/quickstart.yaml"])
    assert r.exit_code == 2 and "give CONFIG and --seeds" in r.output
    r = runner.invoke(app, ["sweep", "examples/quickstart.yaml", "--seeds", "1", "--grid", "trainer.seed=1,2"])
    assert r.exit_code == 2 and "set by the sweep for each run" in r.output
    r = runner.invoke(app, ["sweep", "examples/quickstart.yaml", "--resume", "/nonexistent/sweep"])
    assert r.exit_code == 2 and "drop CONFIG/--seeds/--grid" in r.output
    r = runner.invoke(app, ["sweep", "--resume", "/nonexistent/sweep"])
    assert r.exit_code == 2 and "sweep.json does not exist" in r.output


def test_a_bad_override_fails_before_any_run_starts(tmp_path):
    r = runner.invoke(app, ["sweep", "examples/quickstart.yaml", "--seeds", "1", "--out", str(tmp_path / "s"),
                            "trainer.totl_steps=3"])
    assert r.exit_code == 2 and "did you mean 'trainer.total_steps'" in r.output
    assert not (tmp_path / "s").exists()


def test_report_errors(tmp_path):
    r = runner.invoke(app, ["report", str(tmp_path / "missing")])
    assert r.exit_code == 2 and "is not a directory" in r.output
    r = runner.invoke(app, ["report", str(tmp_path)])
    assert r.exit_code == 2 and "no metrics.jsonl" in r.output
