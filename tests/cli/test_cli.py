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


def _report_dir(tmp_path):
    import json

    import yaml

    for adv in ("grpo", "rloo"):
        for seed in (1, 2):
            d = tmp_path / "sweep" / f"{adv}-{seed}"
            d.mkdir(parents=True)
            (d / "config.yaml").write_text(yaml.safe_dump({"algorithm": {"advantage": adv}, "trainer": {"seed": seed}}))
            (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "val/reward_mean": 0.1 * seed}) + "\n")
    return tmp_path / "sweep"


def test_report_out_works_after_compare(tmp_path):
    sweep = _report_dir(tmp_path)
    r = runner.invoke(app, ["report", str(sweep), "--compare", "advantage=grpo", "--compare", "advantage=rloo",
                            "--out", str(tmp_path / "rep")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "rep" / "report.html").is_file() and "advantage=grpo - advantage=rloo" in r.output


def test_report_compare_needs_two_flags_and_names_a_stray_label(tmp_path):
    sweep = _report_dir(tmp_path)
    r = runner.invoke(app, ["report", str(sweep), "--compare", "advantage=grpo", "--out", str(tmp_path / "rep")])
    assert r.exit_code == 2 and "--compare was given 1 time(s); give exactly two group labels" in r.output
    r = runner.invoke(app, ["report", str(sweep), "--compare", "advantage=grpo", "advantage=rloo"])
    assert r.exit_code == 2
    assert "(advantage=rloo looks like a label given without its own --compare)" in r.output
    assert not (tmp_path / "rep").exists()


def test_serve_reward_port_range_and_fn_named():
    r = runner.invoke(app, ["serve-reward", "--fn", "math", "--port", "99999"])
    assert r.exit_code == 2 and "--port" in r.output and "Traceback" not in r.output
    r = runner.invoke(app, ["serve-reward", "--fn", "bogus"])
    assert r.exit_code == 2 and "error: --fn bogus: unknown reward scorer 'bogus'" in r.output
    assert "rewards.sources" not in r.output
