"""Bad input is a clear error before training, or a counted event during it — never a hang or a crash."""
import json
import time

import pytest

from fleetrl.config import ConfigError, derive_plan, load_config
from fleetrl.data.errors import DataError
from fleetrl.rewards.errors import RewardError, ScorerFailureError
from tests.integration.helpers import train_run

ASSETS = "tests/integration/assets/bad_rewards.py"
FAST = ("cluster.backend=local", "trainer.total_steps=2", "data.prompts_per_step=8", "data.val=null",
        "trainer.val_every=0")


def _rows(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def _good_row(i):
    return {"data_source": "synthetic/copy", "prompt": [{"role": "user", "content": f"copy {i} ="}],
            "reward_model": {"ground_truth": str(i)}}


def test_malformed_row_names_file_row_field(tmp_path):
    rows = [_good_row(i) for i in range(3)] + [{"data_source": "synthetic/copy", "prompt": [{"role": "user"}],
                                                "reward_model": {"ground_truth": "1"}}]
    path = _rows(tmp_path / "train.jsonl", rows)
    with pytest.raises(DataError, match=r"train\.jsonl.*row 3.*prompt"):
        train_run("examples/quickstart.yaml", tmp_path / "out", *FAST, f"data.train={path}")


def test_missing_column(tmp_path):
    path = _rows(tmp_path / "train.jsonl", [{"data_source": "synthetic/copy", "reward_model": {"ground_truth": "1"}}])
    # no row has the column (here the only row): the file's fault, fixed by naming the column (data.input_key)
    with pytest.raises(DataError, match=r"train\.jsonl: no row has the prompt column 'prompt' .*data\.input_key"):
        train_run("examples/quickstart.yaml", tmp_path / "out", *FAST, f"data.train={path}")


def test_unknown_data_source_fails_before_training(tmp_path):
    row = {**_good_row(1), "data_source": "my/unknown_task"}
    path = _rows(tmp_path / "train.jsonl", [row] * 8)
    t0 = time.time()
    with pytest.raises(RewardError, match=r"my/unknown_task.*rewards\.sources"):
        train_run("examples/quickstart.yaml", tmp_path / "out", *FAST, f"data.train={path}")
    assert time.time() - t0 < 30
    metrics = tmp_path / "out" / "metrics.jsonl"
    assert not metrics.exists() or "train/" not in metrics.read_text()


def test_unknown_key_and_batch_arithmetic():
    with pytest.raises(ConfigError, match="did you mean 'rollout.temperature'"):
        load_config("examples/quickstart.yaml", ["rollout.temprature=0.5"])
    with pytest.raises(ConfigError, match="micro_batch_size"):
        derive_plan(load_config("examples/quickstart.yaml", ["algorithm.micro_batch_size=7"]))


def test_reward_that_raises_everywhere_stops_the_run_naming_the_scorer(tmp_path):
    with pytest.raises(ScorerFailureError, match=r"bad_rewards\.py:raises.*synthetic/copy"):
        train_run("examples/quickstart.yaml", tmp_path / "out", *FAST,
                  f"rewards.sources={{synthetic/copy: '{ASSETS}:raises'}}")


def test_reward_that_sleeps_forever_stops_the_run_in_bounded_time(tmp_path):
    t0 = time.time()
    with pytest.raises(ScorerFailureError, match=r"sleeps_forever"):
        train_run("examples/quickstart.yaml", tmp_path / "out", *FAST, "rewards.timeout_s=1",
                  f"rewards.sources={{synthetic/copy: '{ASSETS}:sleeps_forever'}}")
    assert time.time() - t0 < 60  # 64 samples × 1 s each would be over a minute; the scorer is found hung at once


def test_reward_that_raises_is_counted_when_failures_are_allowed(tmp_path):
    metrics = train_run("examples/quickstart.yaml", tmp_path / "out", *FAST, "rewards.max_failure_rate=1.0",
                        f"rewards.sources={{synthetic/copy: '{ASSETS}:raises'}}")
    train = [m for m in metrics if "train/reward_errors" in m]
    assert len(train) == 2
    assert all(m["train/reward_errors"] == 64 and m["train/reward_mean"] == 0.0 for m in train)


def test_reward_that_hangs_times_out_and_run_finishes(tmp_path):
    t0 = time.time()
    metrics = train_run("examples/quickstart.yaml", tmp_path / "out", *FAST, "rewards.timeout_s=0.5", "rewards.max_failure_rate=1.0",
                        "rewards.isolation=process", f"rewards.sources={{synthetic/copy: '{ASSETS}:hangs_on_three'}}")
    train = [m for m in metrics if "train/reward_timeouts" in m]
    assert len(train) == 2 and sum(m["train/reward_timeouts"] for m in train) > 0
    assert time.time() - t0 < 120
