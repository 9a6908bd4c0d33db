import json

import pytest
import yaml

from fleetrl.report import build_report


def _run(root, name, seed, adv, val):
    d = root / name
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump({"algorithm": {"advantage": adv}, "trainer": {"seed": seed}}))
    lines = [{"step": s, "train/reward_mean": v / 2, "train/entropy": 1.0 - v, "val/reward_mean": v}
             for s, v in zip((1, 2, 3), val)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return d


def test_report_table_compare_pngs_and_self_contained_html(tmp_path):
    sweep = tmp_path / "sweep"
    # grpo final val: 0.5, 0.6, 0.7 (mean 0.6); best = final (monotone curves)
    for seed, v in zip((1, 2, 3), (0.5, 0.6, 0.7)):
        _run(sweep, f"grpo-{seed}", seed, "grpo", [0.1, 0.3, v])
    # rloo final val: 0.2, 0.3, 0.4 (mean 0.3); best per seed = 0.9, 0.3, 0.4 (seed 1 peaked at step 2)
    for seed, v, peak in zip((1, 2, 3), (0.2, 0.3, 0.4), (0.9, 0.2, 0.2)):
        _run(sweep, f"rloo-{seed}", seed, "rloo", [0.1, peak, v])
    res = build_report([sweep], tmp_path / "out", compare=("advantage=grpo", "advantage=rloo"))
    rows = {r.group: r for r in res.rows}
    assert res.score_key == "val/reward_mean"
    assert rows["advantage=grpo"].final.mean == 0.6 and rows["advantage=grpo"].seeds == [1, 2, 3]
    assert rows["advantage=rloo"].bests == [0.9, 0.3, 0.4]
    _, _, final, _ = res.comparison
    # difference of means 0.6 - 0.3 = 0.3; both sides have var 0.01 -> se = sqrt(0.01/3 * 2) = 0.081650,
    # dof = 4 (equal variances and sizes): t_{0.975,4} = 2.776445 -> half width 0.226697
    assert abs(final.mean - 0.3) < 1e-12 and abs(final.dof - 4) < 1e-9
    assert abs(final.half_width - 0.226697) < 1e-5
    names = sorted(p.name for p in res.pngs)
    assert names == ["train_entropy.png", "train_reward_mean.png", "val_reward_mean.png"]
    html = res.html.read_text()
    assert html.count("data:image/png;base64,") == 3 and "src='http" not in html and "<script" not in html
    assert "advantage=grpo − advantage=rloo" in html and "+0.3000" in html


def test_the_same_seed_twice_is_counted_once_and_flagged(tmp_path):
    _run(tmp_path / "s1", "r", 1, "grpo", [0.1, 0.2, 0.3])
    _run(tmp_path / "s2", "r", 1, "grpo", [0.1, 0.2, 0.3])
    _run(tmp_path / "s3", "r", 1, "grpo", [0.1, 0.2, 0.35])
    res = build_report([tmp_path / "s1", tmp_path / "s2", tmp_path / "s3"], tmp_path / "out")
    assert res.rows[0].seeds == [1]
    assert "identical metrics (reproduced); counted once" in res.warnings[0]
    # keys are compared in sorted order: train/entropy (1 - 0.3 = 0.7 vs 1 - 0.35 = 0.65) comes first
    assert "DIFFERENT metrics (step 3 train/entropy: 0.7 vs 0.65)" in res.warnings[1]
    assert "DIFFERENT metrics" in res.html.read_text()


def test_compare_names_the_groups_it_knows(tmp_path):
    _run(tmp_path, "a", 1, "grpo", [0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match="no group named advantage=ppo; groups are: all runs"):
        build_report([tmp_path], tmp_path / "out", compare=("advantage=ppo", "all runs"))


def test_a_failed_run_without_config_is_left_out_and_compare_still_works(tmp_path):
    from fleetrl.sweep.manifest import Manifest, RunRecord

    for adv in ("grpo", "rloo"):
        for seed, v in ((1, 0.5), (2, 0.7)):
            _run(tmp_path, f"{adv}-{seed}", seed, adv, [0.1, 0.2, v - (adv == "rloo") * 0.2])
    recs = [RunRecord(name=f"{a}-{s}", seed=s, grid={"algorithm.advantage": a}, state="finished")
            for a in ("grpo", "rloo") for s in (1, 2)]
    recs.append(RunRecord(name="rloo-3", seed=3, grid={"algorithm.advantage": "rloo"}, state="failed", error="boom"))
    Manifest(config="c.yaml", overrides=[], seeds=[1, 2, 3], grid={}, runs=recs).save(tmp_path)
    res = build_report([tmp_path], tmp_path / "out", compare=("advantage=grpo", "advantage=rloo"))
    assert [(r.group, r.seeds) for r in res.rows] == [("advantage=grpo", [1, 2]), ("advantage=rloo", [1, 2])]
    # finals: grpo 0.5, 0.7; rloo 0.3, 0.5 -> difference of means 0.2
    assert abs(res.comparison[2].mean - 0.2) < 1e-12
    assert any("rloo-3: no config.yaml (sweep state failed: boom)" in w for w in res.warnings)
    assert "— (no config.yaml)" in res.html.read_text()


def test_plots_lead_with_what_is_read_first_repeats_are_left_out_and_seeds_is_a_count(tmp_path):
    import re

    # One data source and a 0/1 reward: its per-source means and pass@1 repeat the overall means value for value.
    # approx_kl and clip_frac are both 0 everywhere (one-epoch update): different metrics, both kept.
    for seed in (42, 1337, 7):
        d = tmp_path / f"seed={seed}"
        d.mkdir()
        (d / "config.yaml").write_text(yaml.safe_dump({"trainer": {"seed": seed}}))
        lines = []
        for s in (1, 2, 3):
            r, v = s / 10 + seed / 1e4, s / 5 + seed / 1e4
            lines.append({"step": s, "train/reward_mean": r, "train/reward/copy/mean": r, "val/reward_mean": v,
                          "val/pass@1": v, "val/copy/mean@1": v, "train/actor/grad_norm": 1.0 / s,
                          "train/actor/approx_kl": 0.0, "train/actor/clip_frac": 0.0, "train/time/step": 2.0 + s,
                          "train/entropy": 3.0 - s, "train/kl": 0.01 * s, "train/response_length_mean": 10.0 + s})
        (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    res = build_report([tmp_path], tmp_path / "out")
    html = res.html.read_text()
    primary, secondary = html.split("<h3>More metrics</h3>")
    assert re.findall(r"<img alt='([^']+)'", primary) == [
        "train_reward_mean", "val_reward_mean", "train_response_length_mean", "train_kl", "train_entropy",
        "train_time_step"]
    assert re.findall(r"<img alt='([^']+)'", secondary) == [
        "train_actor_approx_kl", "train_actor_clip_frac", "train_actor_grad_norm"]
    assert [p.stem for p in res.pngs] == re.findall(r"<img alt='([^']+)'", html)  # each metric once
    assert res.plots.repeats == {"val/pass@1": "val/reward_mean", "val/copy/mean@1": "val/reward_mean",
                                 "train/reward/copy/mean": "train/reward_mean"}
    assert "val/pass@1 = val/reward_mean" in secondary
    # the seeds column counts the replicates (3), the seed values are listed beside
    assert "<tr><td>all runs</td><td class='num'>3</td>" in html
    assert "<span class='muted'>1337, 42, 7</span>" in html
