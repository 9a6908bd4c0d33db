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


def test_the_final_table_shows_each_finished_runs_last_step_and_reward(tmp_path, monkeypatch):
    """Each "run" writes steps 9 and 10 to its metrics.jsonl and exits 0. The table after the sweep must read
    `10/10` with the step-10 reward (0.75 for seed 1, 0.5 for seed 2) and the step-9 val reward (0.25), not
    `-/10` and `-`: a run's heartbeat outlives the run, and the exit is seen before the file's last lines."""
    import subprocess
    import sys

    from fleetrl.sweep import runner as sweep_runner
    from fleetrl.sweep.manifest import Manifest
    from fleetrl.sweep.resources import Allocator
    from fleetrl.sweep.validate import run_config

    def fake_start(cls, cmd, env, log_path, cwd=None):
        seed = int(next(a for a in cmd if a.startswith("trainer.seed=")).split("=")[1])
        lines = [{"step": 9, "train/reward_mean": 0.1, "val/reward_mean": 0.25, "train/time/step": 1.0},
                 {"step": 10, "train/reward_mean": 0.75 if seed == 1 else 0.5, "train/time/step": 1.0}]
        metrics = log_path.parent / "metrics.jsonl"
        script = (f"import json\nwith open({str(metrics)!r}, 'a') as f:\n"
                  f"    f.writelines(json.dumps(x) + '\\n' for x in {lines!r})")
        return cls(subprocess.Popen([sys.executable, "-c", script], start_new_session=True), log_path)

    monkeypatch.setattr(sweep_runner.RunProcess, "start", classmethod(fake_start))
    runs = [RunRecord(name=f"seed={s}", seed=s, grid={}) for s in (1, 2)]
    m = Manifest(config="examples/quickstart.yaml", overrides=[], seeds=[1, 2], grid={}, runs=runs)
    cfg = run_config("examples/quickstart.yaml", ["trainer.total_steps=10"])
    console = Console(record=True, force_terminal=True, width=150)
    sweep = sweep_runner.Sweep(tmp_path, m, sweep_runner.SweepOptions(poll_s=0.05, live=True), console,
                               prepared=([cfg, cfg], Allocator([], [], 0, 0, 2)))
    assert sweep.run() == 0
    assert rows(m.runs, sweep.beats, sweep.totals) == [
        ["seed=1", "finished", "10/10", "0.750", "0.250", "1.00", "0:00:00", "shared", "1"],
        ["seed=2", "finished", "10/10", "0.500", "0.250", "1.00", "0:00:00", "shared", "1"],
    ]
    final_table = console.export_text().rsplit("fleetrl sweep", 1)[1]
    assert "10/10" in final_table and "0.750" in final_table and "-/10" not in final_table


def test_a_resumed_sweep_shows_the_runs_an_earlier_invocation_finished(tmp_path):
    from fleetrl.sweep import runner as sweep_runner
    from fleetrl.sweep.manifest import Manifest
    from fleetrl.sweep.resources import Allocator
    from fleetrl.sweep.validate import run_config

    (tmp_path / "seed=1").mkdir()
    (tmp_path / "seed=1" / "metrics.jsonl").write_text('{"step": 10, "train/reward_mean": 0.75}\n')
    runs = [RunRecord(name="seed=1", seed=1, grid={}, state="finished", attempts=1)]
    m = Manifest(config="examples/quickstart.yaml", overrides=[], seeds=[1], grid={}, runs=runs)
    cfg = run_config("examples/quickstart.yaml", ["trainer.total_steps=10"])
    sweep = sweep_runner.Sweep(tmp_path, m, sweep_runner.SweepOptions(live=False), Console(),
                               prepared=([cfg], Allocator([], [], 0, 0, 1)))
    assert rows(m.runs, sweep.beats, sweep.totals)[0][2:4] == ["10/10", "0.750"]
