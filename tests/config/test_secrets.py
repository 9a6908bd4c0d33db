"""Secrets never reach a file fleetrl writes: secret-named keys are redacted in every dump, and configs can take
them from an environment variable or a file instead of holding them."""
import os

import pytest
import yaml

from fleetrl.config import ConfigError, dump_yaml, load_config, redacted_dict, to_dict, write_config
from fleetrl.config.load import is_secret_key, redact_secrets, redact_yaml_text


@pytest.mark.parametrize("name, secret", [("remote_token", True), ("WANDB_API_KEY", True), ("db_password", True),
                                          ("client_secret", True), ("max_new_tokens", False),
                                          ("stop_token_ids", False), ("tokenizer", False), (3, False)])
def test_secret_names_are_suffixes(name, secret):
    assert is_secret_key(name) is secret


def test_redaction_reaches_nested_mappings_and_lists():
    data = {"a": {"api_key": "k", "n": 1}, "b": [{"password": "p"}], "remote_token": None, "hf_token": ""}
    # None and "" are kept: a dump should still show that no secret was given
    assert redact_secrets(data) == {"a": {"api_key": "***", "n": 1}, "b": [{"password": "***"}],
                                    "remote_token": None, "hf_token": ""}


def test_dump_and_tracker_dict_redact_the_reward_token():
    cfg = load_config(None, ["rewards.remote_token=s3cret", "cluster.env={HF_TOKEN: hf_x, OMP_NUM_THREADS: '1'}"])
    assert to_dict(cfg)["rewards"]["remote_token"] == "s3cret"  # the live config keeps it for the client
    red = redacted_dict(cfg)
    assert red["rewards"]["remote_token"] == "***" and red["cluster"]["env"] == {"HF_TOKEN": "***",
                                                                                  "OMP_NUM_THREADS": "1"}
    assert "s3cret" not in dump_yaml(cfg) and "hf_x" not in dump_yaml(cfg)
    assert "s3cret" in dump_yaml(cfg, redact=False)


def test_written_config_is_owner_only_even_over_an_existing_file(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("old")
    os.chmod(path, 0o644)
    write_config(path, load_config(None, ["rewards.remote_token=s3cret"]))
    assert path.stat().st_mode & 0o777 == 0o600
    assert yaml.safe_load(path.read_text())["rewards"]["remote_token"] == "***"


def test_old_clear_text_config_is_redacted_when_read_back():
    assert yaml.safe_load(redact_yaml_text("rewards:\n  remote_token: abc\n  n: 2\n")) == \
        {"rewards": {"remote_token": "***", "n": 2}}


def test_token_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("FLEETRL_REWARD_TOKEN", "from-env")
    path = tmp_path / "c.yaml"
    path.write_text("rewards:\n  remote_token: ${env:FLEETRL_REWARD_TOKEN}\n")
    assert load_config(path).rewards.remote_token == "from-env"
    assert load_config(None, ["rewards.remote_token=${env:FLEETRL_REWARD_TOKEN}"]).rewards.remote_token == "from-env"


def test_token_from_file_strips_one_newline(tmp_path):
    (tmp_path / "tok").write_text("from-file\n")
    cfg = load_config(None, [f"rewards.remote_token=${{file:{tmp_path / 'tok'}}}"])
    assert cfg.rewards.remote_token == "from-file"


def test_missing_env_or_file_names_the_key(monkeypatch, tmp_path):
    monkeypatch.delenv("NO_SUCH_VAR_X", raising=False)
    with pytest.raises(ConfigError, match=r"rewards.remote_token: \$\{env:NO_SUCH_VAR_X\} .* not set; export"):
        load_config(None, ["rewards.remote_token=${env:NO_SUCH_VAR_X}"])
    with pytest.raises(ConfigError, match=r"rewards.remote_token: .*does not exist"):
        load_config(None, [f"rewards.remote_token=${{file:{tmp_path / 'nope'}}}"])


def test_text_around_a_reference_is_left_alone():
    assert load_config(None, ["trainer.name=run-${env:HOME}"]).trainer.name == "run-${env:HOME}"
