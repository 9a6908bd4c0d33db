import json

import yaml

from fleetrl.report.load import (
    Run,
    assign_groups,
    find_runs,
    read_metrics,
    run_warnings,
    same_metrics,
)


def _jsonl(path, lines):
    path.write_text("".join((json.dumps(x) if isinstance(x, dict) else x) + "\n" for x in lines))
    return path


def test_restart_keeps_the_last_record_of_each_step(tmp_path):
    m = _jsonl(tmp_path / "metrics.jsonl", [
        {"step": 0, "val/reward_mean": 0.1},
        {"step": 1, "train/reward_mean": 0.2},
        {"step": 2, "train/reward_mean": 0.3},
        {"step": 3, "train/reward_mean": 0.4},        # written after the checkpoint at 2, then the run died
        '{"step": 4, "train/rew',                      # torn by the kill
        {"step": 3, "event": "restart", "source": "sweep"},
        {"step": 2, "event": "resumed"},
        {"step": 3, "train/reward_mean": 0.45},       # the repeat of step 3 wins
        {"step": 3, "val/reward_mean": 0.5},          # same segment: merged into step 3
        {"step": 4, "train/reward_mean": 0.6, "superseded": True},
        {"step": 4, "train/reward_mean": 0.7},
    ])
    steps, events, torn = read_metrics(m)
    assert sorted(steps) == [0, 1, 2, 3, 4]
    assert steps[3] == {"train/reward_mean": 0.45, "val/reward_mean": 0.5}
    assert steps[4] == {"train/reward_mean": 0.7}
    assert steps[2] == {"train/reward_mean": 0.3}  # not repeated after the resume: the original stands
    assert torn == 1 and [e["event"] for e in events] == ["restart", "resumed"]


def test_a_step_going_backwards_starts_a_new_segment_without_an_event(tmp_path):
    m = _jsonl(tmp_path / "metrics.jsonl", [
        {"step": 1, "train/reward_mean": 1.0, "train/kl": 9.0}, {"step": 2, "train/reward_mean": 2.0},
        {"step": 1, "train/reward_mean": 5.0},  # a retry from scratch: its step 1 replaces the whole old one
    ])
    steps, _, _ = read_metrics(m)
    assert steps == {1: {"train/reward_mean": 5.0}, 2: {"train/reward_mean": 2.0}}


def _run_dir(root, name, seed, adv, rewards):
    d = root / name
    d.mkdir(parents=True)
    cfg = {"algorithm": {"advantage": adv}, "trainer": {"seed": seed, "output_dir": str(d)}}
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    _jsonl(d / "metrics.jsonl", [{"step": i + 1, "train/reward_mean": r, "train/time/step": 0.1 * seed}
                                 for i, r in enumerate(rewards)])
    return d


def test_groups_come_from_differing_config_values_not_seeds(tmp_path):
    _run_dir(tmp_path, "a", 1, "grpo", [0.1])
    _run_dir(tmp_path, "b", 2, "grpo", [0.2])
    _run_dir(tmp_path, "c", 1, "rloo", [0.3])
    runs = find_runs([tmp_path])
    assert {r.name: r.group for r in runs} == {"a": "advantage=grpo", "b": "advantage=grpo", "c": "advantage=rloo"}
    assert [r.seed for r in runs] == [1, 2, 1]


def test_one_config_is_one_group(tmp_path):
    runs = [Run(path=tmp_path / "x", steps={}, config={"trainer.seed": s, "a.b": 1}) for s in (1, 2)]
    assert assign_groups(runs) == [] and {r.group for r in runs} == {"all runs"}


def test_same_metrics_ignores_timings_and_names_the_first_difference(tmp_path):
    a = Run(path=tmp_path, steps={1: {"train/reward_mean": 0.5, "train/time/step": 1.0}})
    b = Run(path=tmp_path, steps={1: {"train/reward_mean": 0.5, "train/time/step": 2.0}})
    c = Run(path=tmp_path, steps={1: {"train/reward_mean": 0.25}})
    assert same_metrics(a, b) is None
    assert same_metrics(a, c) == "step 1 train/reward_mean: 0.5 vs 0.25"


def _sweep_with_a_failed_run(root):
    """Two finished runs (grpo, rloo) and one that failed before writing config.yaml or metrics.jsonl."""
    from fleetrl.sweep.manifest import Manifest, RunRecord

    _run_dir(root, "advantage=grpo,seed=1", 1, "grpo", [0.1])
    _run_dir(root, "advantage=rloo,seed=1", 1, "rloo", [0.2])
    recs = [RunRecord(name="advantage=grpo,seed=1", seed=1, grid={"algorithm.advantage": "grpo"}, state="finished"),
            RunRecord(name="advantage=rloo,seed=1", seed=1, grid={"algorithm.advantage": "rloo"}, state="finished"),
            RunRecord(name="advantage=rloo,seed=2", seed=2, grid={"algorithm.advantage": "rloo"}, state="failed",
                      error="exited with code 1\nTraceback ...")]
    Manifest(config="c.yaml", overrides=[], seeds=[1, 2], grid={"algorithm.advantage": ["grpo", "rloo"]},
             runs=recs).save(root)


def test_a_run_without_config_gets_no_group_and_does_not_spoil_the_others(tmp_path):
    _sweep_with_a_failed_run(tmp_path)
    runs = {r.name: r for r in find_runs([tmp_path])}
    assert {n: r.group for n, r in runs.items()} == {"advantage=grpo,seed=1": "advantage=grpo",
                                                     "advantage=rloo,seed=1": "advantage=rloo",
                                                     "advantage=rloo,seed=2": ""}
    failed = runs["advantage=rloo,seed=2"]
    assert failed.sweep_state == "failed" and failed.seed == 2  # the seed comes from the manifest
    assert run_warnings(list(runs.values())) == [
        f"{failed.path}: no config.yaml (sweep state failed: exited with code 1); left out of the groups, curves "
        f"and score table"]


def test_an_empty_metrics_file_is_a_warning(tmp_path):
    d = _run_dir(tmp_path, "a", 1, "grpo", [])
    assert (d / "metrics.jsonl").read_text() == ""
    runs = find_runs([tmp_path])
    assert run_warnings(runs) == [f"{d}/metrics.jsonl holds no step record (the run logged nothing yet); the run "
                                  f"has no curve and no score"]


def test_a_damaged_manifest_is_a_warning_the_runs_are_still_read(tmp_path):
    _run_dir(tmp_path, "a", 1, "grpo", [0.1])
    (tmp_path / "sweep.json").write_text("{bad")
    warnings = []
    runs = find_runs([tmp_path], warnings)
    assert [r.name for r in runs] == ["a"] and runs[0].sweep_state is None
    assert len(warnings) == 1 and warnings[0].startswith(f"{tmp_path / 'sweep.json'}: not valid JSON")
    assert warnings[0].endswith("(the report shows the run directories without sweep states)")
