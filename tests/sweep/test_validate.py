"""A sweep is checked whole before anything exists on disk: grid keys, every grid point's config and plan, the
machine's resources; a damaged sweep.json is named with the way out."""
import json

import pytest
from rich.console import Console
from typer.testing import CliRunner

from fleetrl.cli.main import app
from fleetrl.config import ConfigError
from fleetrl.sweep import Manifest, ManifestError, SweepOptions, new_sweep, start_sweep
from fleetrl.sweep.validate import check_grid_keys

runner = CliRunner()
QUICK = "examples/quickstart.yaml"


def test_a_bad_grid_value_fails_before_the_sweep_dir_exists(tmp_path):
    # grpo is fine; rlooo only fails in derive_plan (advantage is a free string in the schema)
    r = runner.invoke(app, ["sweep", QUICK, "--seeds", "1", "--grid", "algorithm.advantage=grpo,rlooo",
                            "--out", str(tmp_path / "s")])
    assert r.exit_code == 2
    assert "--grid point algorithm.advantage=rlooo" in r.output and "did you mean 'rloo'" in r.output
    assert not (tmp_path / "s").exists()


def test_a_bad_environment_in_the_grid_fails_before_the_sweep_dir_exists(tmp_path):
    # The plan passes (config knows no environments); the sweep checks the spec itself (envs/check.py).
    r = runner.invoke(app, ["sweep", "examples/tools_lookup_tiny.yaml", "--seeds", "1", "--grid",
                            "rollout.env.name=lookup,lokup", "--out", str(tmp_path / "s")])
    assert r.exit_code == 2, r.output
    assert "--grid point rollout.env.name=lokup" in r.output and "unknown environment 'lokup'" in r.output
    assert not (tmp_path / "s").exists()


def test_a_bad_base_override_is_not_blamed_on_the_grid(tmp_path):
    r = runner.invoke(app, ["sweep", QUICK, "algorithm.clip_low=1.5", "--seeds", "1", "--grid",
                            "algorithm.advantage=grpo,rloo", "--out", str(tmp_path / "s")])
    assert r.exit_code == 2 and "algorithm.clip_low must be in [0, 1]" in r.output, r.output
    assert "--grid point" not in r.output and not (tmp_path / "s").exists()


def test_a_grid_key_without_its_section_gets_the_full_key(tmp_path):
    r = runner.invoke(app, ["sweep", QUICK, "--seeds", "1", "--grid", "advantage=grpo,rloo",
                            "--out", str(tmp_path / "s")])
    assert r.exit_code == 2
    assert "--grid advantage=grpo,rloo: unknown config key 'advantage'; did you mean 'algorithm.advantage'?" \
        in r.output
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("key, hint", [
    ("lr", "'lr' is in actor.optim.lr, critic.optim.lr: give the full dotted key"),
    ("algorithm.advantag", "did you mean 'algorithm.advantage'?"),
])
def test_grid_key_hints(key, hint):
    with pytest.raises(ConfigError, match="^--grid " + key) as e:
        check_grid_keys({key: ["1", "2"]})
    assert hint in str(e.value)


def test_keys_below_a_mapping_are_the_users():
    check_grid_keys({"cluster.pools.main.gpus_per_worker": ["1"], "actor.lora.rank": ["8"], "data.train": ["x"]})


def test_too_many_gpus_per_run_fails_before_the_sweep_dir_exists(tmp_path, monkeypatch):
    monkeypatch.setattr("fleetrl.sweep.runner.detect_gpus", lambda: ["0"])
    r = runner.invoke(app, ["sweep", QUICK, "--seeds", "1", "--gpus-per-run", "2", "--out", str(tmp_path / "s")])
    assert r.exit_code == 2 and "each run needs 2 GPU(s) but this machine shows 1" in r.output
    assert not (tmp_path / "s").exists()


def test_new_sweep_writes_the_manifest_when_all_points_are_valid(tmp_path, monkeypatch):
    monkeypatch.setattr("fleetrl.sweep.runner.detect_gpus", lambda: [])
    sweep_dir, m = new_sweep(QUICK, [1, 2], {"algorithm.advantage": ["grpo", "rloo"]}, [], tmp_path / "s",
                             SweepOptions())
    assert [r.name for r in m.runs] == ["advantage=grpo,seed=1", "advantage=rloo,seed=1",
                                        "advantage=grpo,seed=2", "advantage=rloo,seed=2"]
    assert Manifest.load(sweep_dir).runs[3].grid == {"algorithm.advantage": "rloo"}


def test_start_sweep_loads_each_point_once_and_probes_the_gpus_once(tmp_path, monkeypatch):
    probes, loads = [], []
    monkeypatch.setattr("fleetrl.sweep.runner.detect_gpus", lambda: probes.append(1) or [])
    import fleetrl.sweep.validate as v

    real = v.run_config
    monkeypatch.setattr(v, "run_config", lambda c, o: loads.append(tuple(o)) or real(c, o))
    sw = start_sweep(QUICK, [1, 2], {"algorithm.advantage": ["grpo", "rloo"]}, [], tmp_path / "s", SweepOptions(),
                     Console(quiet=True))
    assert len(probes) == 1  # the resource check before the dir exists is the allocator the sweep runs with
    assert sorted(loads) == sorted({*loads}) and len(loads) == 4  # one load per run, none again in Sweep()
    assert sw.totals == {r.name: 80 for r in sw.m.runs} and sw.alloc.max_parallel >= 1


@pytest.mark.parametrize("text, what", [
    ("{bad", "not valid JSON (Expecting property name enclosed in double quotes at line 1, column 2)"),
    ("[1]", "expected a JSON object, got list"),
    (json.dumps({"version": 1, "config": "c", "overrides": [], "seeds": [1], "grid": {}}),
     "field 'runs' is missing"),
    (json.dumps({"version": 1, "config": "c", "overrides": [], "seeds": [1], "grid": {}, "runs": [{"name": "a"}]}),
     "RunRecord: missing 2 required keyword-only arguments: 'seed' and 'grid'"),
])
def test_a_damaged_manifest_is_named_with_the_way_out(tmp_path, text, what):
    (tmp_path / "sweep.json").write_text(text)
    with pytest.raises(ManifestError) as e:
        Manifest.load(tmp_path)
    msg = str(e.value)
    assert msg.startswith(f"{tmp_path / 'sweep.json'}: ") and what in msg
    assert "start a new sweep with another --out" in msg
    assert (tmp_path / "sweep.json").read_text() == text  # left as it was


def test_a_damaged_manifest_points_at_the_tmp_copy_and_resume_exits_2(tmp_path):
    (tmp_path / "sweep.json").write_text("{bad")
    (tmp_path / "sweep.json.tmp").write_text("{}")
    r = runner.invoke(app, ["sweep", "--resume", str(tmp_path)])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert f"restore it from {tmp_path / 'sweep.json.tmp'}" in r.output
