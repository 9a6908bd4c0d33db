"""Bad config input gets a ConfigError naming the file / key, the value, what was expected and the fix:
non-UTF-8 files, duplicate YAML keys, readable type names, numeric ranges, trainer.resume typos."""
import re
from pathlib import Path
from typing import Literal, Mapping

import pytest
import yaml

from fleetrl.config import ConfigError, derive_plan, load_config
from fleetrl.config.checks import RANGES, _lookup
from fleetrl.config.load import describe_type, load_yaml
from fleetrl.config.schema import EnvConfig

QUICKSTART = "examples/quickstart.yaml"


def _plan(*overrides: str):
    return derive_plan(load_config(QUICKSTART, list(overrides)))


# ------------------------------------------------------------------------------------------- encoding
def test_a_utf16_file_is_named_and_must_be_utf8(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_bytes(b"\xff\xfem\x00o\x00d\x00")
    with pytest.raises(ConfigError, match=rf"{re.escape(str(path))}: not UTF-8 text \(it starts with a UTF-16 byte-order mark\).*"
                                          r"must be UTF-8 text"):
        load_config(path)


def test_a_latin1_byte_is_located(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_bytes(b"trainer:\n  name: caf\xe9\n")  # 9 + 11 bytes before \xe9
    with pytest.raises(ConfigError, match=rf"{re.escape(str(path))}: not UTF-8 text: byte b'\\xe9' at offset 20"):
        load_config(path)


def test_a_utf8_byte_order_mark_is_fine(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_bytes(b"\xef\xbb\xbftrainer:\n  name: bom\n")
    assert load_config(path).trainer.name == "bom"


# -------------------------------------------------------------------------------------- duplicate keys
def test_a_second_top_level_section_is_rejected_with_both_lines(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("trainer:\n  seed: 1\nrollout:\n  n: 4\ntrainer: {seed: 5}\n")
    with pytest.raises(ConfigError, match=rf"{re.escape(str(path))}: key 'trainer' is given twice \(line 1 and line 5\)"):
        load_config(path)


def test_quickstart_with_a_trailing_trainer_section_is_rejected(tmp_path):
    path = tmp_path / "quickstart.yaml"
    path.write_text(Path(QUICKSTART).read_text() + "trainer: {seed: 5}\n")
    with pytest.raises(ConfigError, match=r"key 'trainer' is given twice \(line \d+ and line \d+\)"):
        load_config(path)


def test_a_nested_duplicate_names_its_dotted_path(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("cluster:\n  pools:\n    main:\n      nodes: 1\n      nodes: 2\n")
    with pytest.raises(ConfigError, match=r"key 'cluster.pools.main.nodes' is given twice \(line 4 and line 5\)"):
        load_config(path)


def test_keys_merged_from_an_anchor_may_be_overridden(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("cluster:\n  pools:\n    main: &pool {nodes: 1, cpus_per_worker: 1}\n"
                    "  fallback_pools:\n    main:\n      <<: *pool\n      cpus_per_worker: 0.5\n")
    cfg = load_config(path)
    assert cfg.cluster.fallback_pools["main"].cpus_per_worker == 0.5
    assert cfg.cluster.fallback_pools["main"].nodes == 1


def test_a_chain_of_merges_is_not_a_duplicate():
    # Building `c` merges `b`, which PyYAML rewrites in place with what it merged from `a`: a check made while
    # building saw x twice in `b`. yaml.safe_load accepts this text, and so must the loader. Our contract is
    # "the loader equals yaml.safe_load", not a PyYAML version's merge result: 6.0.3 gives c.x = 2, 6.0.4 gives 1.
    text = "defs:\n  a: &a {x: 1}\n  b: &b\n    <<: *a\n    x: 2\nc:\n  <<: *b\n"
    loaded = load_yaml(text)
    assert loaded == yaml.safe_load(text)
    assert loaded["defs"]["b"] == {"x": 2} and set(loaded["c"]) == {"x"}


def test_a_duplicate_inside_an_override_value_is_rejected():
    with pytest.raises(ConfigError, match=r"override 'trainer=\{seed: 1, seed: 2\}': key 'seed' is given twice"):
        load_config(None, ["trainer={seed: 1, seed: 2}"])


@pytest.mark.parametrize("path", sorted(Path("examples").glob("*.yaml")) + sorted(Path("bench").glob("*.yaml")),
                         ids=str)
def test_every_shipped_config_still_loads_and_derives(path):
    assert derive_plan(load_config(path), train_prompts=1000).total_steps >= 1


# ---------------------------------------------------------------------------------------- type names
def test_a_number_or_auto_is_described_for_people():
    with pytest.raises(ConfigError, match=r"^cluster.call_timeout_s: expected a number or 'auto', got str 'fast'$"):
        load_config(QUICKSTART, ["cluster.call_timeout_s=fast"])


def test_an_optional_scalar_says_null_is_allowed():
    with pytest.raises(ConfigError, match=r"^data.val_max_prompts: expected an integer or null, got str 'ten'$"):
        load_config(None, ["data.val_max_prompts=ten"])


def test_an_optional_section_keeps_the_inner_key_in_its_error():
    with pytest.raises(ConfigError, match=r"^rollout.env.max_turns: expected an integer, got str 'a'$"):
        load_config(None, ["rollout.env={name: lookup, max_turns: a}"])


@pytest.mark.parametrize(("tp", "words"), [
    (float | Literal["auto"], "a number or 'auto'"),
    (int | None, "an integer or null"),
    (Literal["hold", "drop"], "'hold' or 'drop'"),
    (Mapping[str, float] | None, "a mapping or null"),
    (tuple[str, ...], "a list"),
    (EnvConfig | None, "a section (mapping) or null"),
    (bool, "true or false"),
])
def test_describe_type(tp, words):
    assert describe_type(tp) == words


# --------------------------------------------------------------------------------------------- ranges
@pytest.mark.parametrize("value", ["0", "-8"])
def test_micro_batch_size_must_be_positive(value):
    with pytest.raises(ConfigError, match=rf"^algorithm.micro_batch_size must be >= 1 .*got {value}$"):
        _plan(f"algorithm.micro_batch_size={value}")


@pytest.mark.parametrize(("override", "match"), [
    ("rollout.top_k=-3", r"rollout.top_k must be >= 0 \(0 = off\), got -3"),
    ("algorithm.clip_low=-1", r"algorithm.clip_low must be in \[0, 1\] .*got -1.0"),
    ("algorithm.clip_low=1.5", r"algorithm.clip_low must be in \[0, 1\] .*got 1.5"),
    ("data.val_max_prompts=-1", r"data.val_max_prompts must be >= 1 \(null = every validation prompt\), got -1"),
    ("cluster.call_timeout_s=-5", r"cluster.call_timeout_s must be > 0 seconds, or auto, got -5.0"),
    ("rollout.top_p=0", r"rollout.top_p must be in \(0, 1\] \(1 = off\), got 0.0"),
    ("rollout.top_p=1.5", r"rollout.top_p must be in \(0, 1\] \(1 = off\), got 1.5"),
    ("rollout.temperature=-0.1", r"rollout.temperature must be >= 0 \(0 = greedy\), got -0.1"),
    ("rollout.val_n=0", r"rollout.val_n must be >= 1, got 0"),
    ("rollout.stop_token_ids=[2,-1]", r"rollout.stop_token_ids\[1\] must be >= 0 .*got -1"),
    ("algorithm.gamma=.nan", r"algorithm.gamma must be in \[0, 1\], got nan"),
    ("algorithm.mini_batch_prompts=0", r"algorithm.mini_batch_prompts must be >= 1 .*got 0"),
    ("algorithm.ppo_epochs=0", r"algorithm.ppo_epochs must be >= 1, got 0"),
    ("algorithm.kl.coef=-0.1", r"algorithm.kl.coef must be >= 0, got -0.1"),
    ("actor.optim.betas=[0.9,1.0]", r"actor.optim.betas\[1\] must be in \[0, 1\), got 1.0"),
    ("critic.optim.eps=0", r"critic.optim.eps must be > 0, got 0.0"),
    ("rewards.timeout_s=0", r"rewards.timeout_s must be > 0 seconds, got 0.0"),
    ("rewards.max_failure_rate=2", r"rewards.max_failure_rate must be in \[0, 1\] \(1 = never stop\), got 2.0"),
    ("trainer.val_every=-1", r"trainer.val_every must be >= 0 \(0 = off\), got -1"),
    ("cluster.call_timeouts={generate: 0}", r"cluster.call_timeouts.generate must be > 0 seconds, got 0.0"),
    ("cluster.stall_s=0", r"cluster.stall_s must be > 0 seconds, got 0.0"),
    ("cluster.pools.main.cpus_per_worker=-1", r"cluster.pools.main.cpus_per_worker must be >= 0, got -1.0"),
    ("rollout.env={name: lookup, max_total_tokens: 0}", r"rollout.env.max_total_tokens must be >= 1, got 0"),
])
def test_an_out_of_range_number_names_key_value_and_range(override, match):
    with pytest.raises(ConfigError, match=f"^{match}$"):
        _plan(override)


def test_the_edges_of_each_range_are_accepted():
    plan = _plan("rollout.top_k=0", "rollout.top_p=1", "rollout.temperature=0", "algorithm.clip_low=0",
                 "cluster.call_timeout_s=auto", "data.val_max_prompts=null", "actor.optim.grad_clip=0",
                 "rewards.max_failure_rate=1", "algorithm.gamma=0", "cluster.call_timeout_s=0.5")
    assert _plan("algorithm.policy_loss=cispo", "algorithm.clip_low=1.0").config.algorithm.clip_low == 1.0  # CISPO
    assert plan.config.rollout.top_k == 0 and plan.config.cluster.call_timeout_s == 0.5


def test_every_range_row_names_a_schema_key():
    cfg = load_config(None, ["rollout.env={name: lookup}"])  # so the rollout.env rows resolve too
    for key, _, _ in RANGES:
        _lookup(cfg, key)  # AttributeError on a typo in the table


# --------------------------------------------------------------------------------------- trainer.resume
def test_a_resume_typo_suggests_the_keyword():
    with pytest.raises(ConfigError, match=r"^trainer.resume='atuo' is neither auto, never nor an existing path; "
                                          r"did you mean 'auto'\? \(accepted: auto = .*never = .*path of a "
                                          r"checkpoint directory"):
        _plan("trainer.resume=atuo")
    with pytest.raises(ConfigError, match=r"did you mean 'never'\?"):
        _plan("trainer.resume=Never")


def test_a_path_missing_here_is_left_to_the_run_that_resumes(tmp_path):
    # The plan is also derived where a run is prepared (a sweep, a slurm script), which may not see the path the
    # run resumes from; find_resume names a missing checkpoint where the run starts.
    missing = tmp_path / "checkpoints" / "step_4"
    assert _plan(f"trainer.resume={missing}").config.trainer.resume == str(missing)


def test_an_empty_resume_is_not_the_current_directory():
    with pytest.raises(ConfigError, match=r"^trainer.resume='' is neither auto, never nor an existing path"):
        _plan("trainer.resume=")


def test_an_existing_resume_path_and_the_keywords_pass(tmp_path):
    for value in ("auto", "never", str(tmp_path)):
        assert _plan(f"trainer.resume={value}").config.trainer.resume == value


def test_a_section_without_its_required_key_names_it():
    # rollout.env has no default name: the dataclass alone would raise a TypeError naming no key.
    with pytest.raises(ConfigError, match=r"^rollout.env: rollout.env.name must be set"):
        load_config("examples/quickstart.yaml", ["rollout.env={max_turns: 2}"])
