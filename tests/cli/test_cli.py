from typer.testing import CliRunner

from fleetrl.cli.main import app

runner = CliRunner()


def test_config_show_prints_config_and_plan():
    r = runner.invoke(app, ["config", "show", "examples/ppo_tiny.yaml", "rollout.n=4"])
    assert r.exit_code == 0, r.output
    assert "advantage: gae" in r.output and '"samples_per_step": 64' in r.output and '"use_critic": true' in r.output


def test_bad_key_is_exit_2_with_did_you_mean():
    r = runner.invoke(app, ["config", "show", "examples/quickstart.yaml", "trainer.totl_steps=3"])
    assert r.exit_code == 2 and "did you mean 'trainer.total_steps'" in r.output


def test_train_rejects_impossible_arithmetic_before_starting():
    r = runner.invoke(app, ["train", "examples/quickstart.yaml", "algorithm.micro_batch_size=7"])
    assert r.exit_code == 2 and "micro_batch_size" in r.output


def test_missing_config_file():
    r = runner.invoke(app, ["train", "nope.yaml"])
    assert r.exit_code == 2 and "does not exist" in r.output
