"""bench/race_trl.py: fleetrl's side of the race is the README's main GPU job (examples/grpo_smollm2_gpu.yaml) with
the race's settings, the Wilson interval and the race table are computed right."""
import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

from fleetrl.config import load_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import race_trl  # noqa: E402

RESULTS = Path(__file__).resolve().parents[2] / "bench/results/race_h200_2026-11-27_leaky_val/race"


def _args(**kw):
    base = dict(data=Path("/d"), val_rows=None, steps=150, val_every=10, seed=0)
    return type("Args", (), {**base, **kw})()


def test_the_example_with_the_race_overrides_is_the_config_that_was_raced():
    # the first H200 race (recorded in its result) spelled the whole config out one key at a time; later ones run the
    # example itself with race_trl.fleetrl_overrides
    raced = json.loads((RESULTS / "fleetrl_s0.json").read_text())["fleetrl_overrides"]
    as_raced = load_config(None, raced)
    data = Path("/tmp/carry/files/data/race")
    now = load_config(race_trl.EXAMPLE, race_trl.fleetrl_overrides(_args(data=data), Path(
        "/tmp/race-runs/fleetrl_s0_run")))
    now = dataclasses.replace(now, actor=dataclasses.replace(now.actor, compile=True),  # as on the GPU
                              cluster=dataclasses.replace(now.cluster, pools=as_raced.cluster.pools))
    assert dataclasses.asdict(now) == dataclasses.asdict(as_raced)


def test_the_shared_hyper_parameters_are_the_examples():
    cfg = load_config(race_trl.EXAMPLE)
    hp = race_trl.HP
    assert (cfg.data.prompts_per_step, cfg.rollout.n, cfg.rollout.max_new_tokens, cfg.rollout.temperature) == (
        hp["prompts_per_step"], hp["n"], hp["max_new_tokens"], hp["temperature"])
    assert (cfg.actor.optim.lr, cfg.actor.optim.grad_clip, cfg.algorithm.clip_low, cfg.algorithm.clip_high) == (
        hp["lr"], hp["grad_clip"], hp["clip_eps"], hp["clip_eps"])
    # TRL's defaults the race keeps: no KL term (beta=0), constant lr, no weight decay, AdamW's betas and eps
    assert cfg.algorithm.kl.placement == "none" and cfg.actor.optim.schedule == "constant"
    assert (cfg.actor.optim.weight_decay, cfg.actor.optim.betas, cfg.actor.optim.eps) == (0.0, (0.9, 0.999), 1e-8)
    assert cfg.algorithm.loss_agg == "token-mean" and cfg.algorithm.norm_adv_by_std  # TRL: dapo, scale "group"


def test_wilson_interval_by_hand():
    # 122/200: p = 0.61, z^2 = 3.8416; centre = (0.61 + 3.8416/400) / (1 + 3.8416/200) = 0.607927,
    # half = 1.96 sqrt(0.61*0.39/200 + 3.8416/160000) / 1.019208 = 0.066991
    low, high = race_trl.wilson(122, 200)
    assert low == pytest.approx(0.540936, abs=1e-5) and high == pytest.approx(0.674917, abs=1e-5)
    assert race_trl.wilson(0, 10)[0] == 0.0 and race_trl.wilson(10, 10)[1] == 1.0


def _run(framework, seed, acc, val_curve=(), tag="", error=None):
    ev = {"correct": round(acc * 100), "n": 100, "acc": acc, "wilson95": list(race_trl.wilson(round(acc * 100), 100))}
    steps = [{"step": 1, "elapsed_s": 5.0, "reward": 0.1, "step_s": 3.0},
             {"step": 2, "elapsed_s": 6.0, "reward": 0.2, "step_s": 1.0},
             {"step": 3, "elapsed_s": 8.0, "reward": 0.3, "step_s": 2.0}]
    return {"framework": framework, "seed": seed, "tag": tag, "steps": steps, "wall_s": 10.0, "eval_before": ev,
            "eval_after": None if error else ev, "error": error,
            "val_curve": [{"step": s, "elapsed_s": t, "acc": a} for s, t, a in val_curve]}


def test_time_to_reach_is_fleetrls_first_validation_at_trls_mean_final_accuracy():
    results = [_run("trl", 0, 0.50), _run("trl", 1, 0.60), _run("trl", 2, 0.0, error="diverged"),
               _run("fleetrl", 0, 0.7, [(0, 1.0, 0.3), (10, 4.0, 0.54), (20, 7.0, 0.55), (30, 9.0, 0.6)]),
               _run("fleetrl", 1, 0.5, [(0, 1.0, 0.3), (10, 4.0, 0.5)])]
    assert race_trl.trl_target(results) == pytest.approx(0.55)  # the diverged run has no final accuracy
    rows = {(r["run"], r["seed"]): r for r in race_trl.summarize(results)}
    assert rows[("fleetrl", 0)]["reach_trl_final_s"] == 7.0  # 0.55 >= 0.55 at 7 s; 0.54 at 4 s is short
    assert rows[("fleetrl", 1)]["reach_trl_final_s"] is None
    assert rows[("fleetrl", 0)]["s_per_step"] == 1.5  # median of steps 2 and 3: the first holds warm-up
    table = race_trl.markdown(race_trl.summarize(results), race_trl.trl_target(results))
    assert "| fleetrl | 1 |" in table and "not reached" in table and "failed: diverged" in table


def test_the_race_data_command_makes_disjoint_train_and_held_out_rows(tmp_path):
    # the README's `python bench/race_trl.py data --out data/race`, into tmp_path
    pytest.importorskip("reasoning_gym", reason="the race data comes from reasoning-gym: pip install 'fleetrl[data]'")
    import pyarrow.parquet as pq

    assert race_trl.main(["data", "--out", str(tmp_path)]) == 0
    train, val = (pq.read_table(tmp_path / f"{s}.parquet").to_pylist() for s in ("train", "val"))
    assert (len(train), len(val)) == (sum(n for n, _ in race_trl.SIZES.values()), race_trl.VAL_ROWS) == (2120, 200)
    question = [r["prompt"][-1]["content"] for r in val]
    assert not set(question) & {r["prompt"][-1]["content"] for r in train}
    assert len(set(question)) == 200


def test_the_stamper_reads_each_record_once_even_when_caught_mid_line(tmp_path):
    import time

    path = tmp_path / "metrics.jsonl"
    stamper = race_trl.JsonlStamper(path, time.perf_counter())
    stamper.start()
    with path.open("w") as f:
        f.write('{"step": 1}\n{"st')  # the trainer is halfway through its second record
        f.flush()
        time.sleep(0.35)
        f.write('ep": 2}\n')
    time.sleep(0.35)
    stamper.done.set()
    stamper.join(timeout=5)
    assert [r["step"] for r in stamper.records] == [1, 2]
    assert stamper.records[0]["elapsed_s"] < stamper.records[1]["elapsed_s"]


def test_trls_guarded_optimiser_skips_a_nonfinite_update_and_applies_a_finite_one():
    """fleetrl's on_nonfinite=skip rule given to TRL's AdamW. First AdamW step, bias-corrected, no weight decay:
    p - lr * g / (|g| + eps) = 1 - 0.1 * 2 / 2 = 0.9 (to ~1e-9)."""
    from types import SimpleNamespace

    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    config = SimpleNamespace(learning_rate=0.1, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.0)
    opt = race_trl.guarded_adamw(model, config, fused=False)
    model.weight.grad = torch.tensor([[float("nan")]])
    opt.step()
    assert model.weight.item() == 1.0 and opt.skipped == 1
    model.weight.grad = torch.tensor([[2.0]])
    opt.step()
    assert model.weight.item() == pytest.approx(0.9, abs=1e-6) and opt.skipped == 1
