"""load_dataset (specs, weights, synthetic) and MixtureSampler reproducibility and resuming."""
from __future__ import annotations

import json
from collections import Counter

import pytest

from fleetrl.data import SYNTHETIC_TASKS, DataError, MixtureSampler, load_dataset

LOAD = dict(max_prompt_length=64)


@pytest.fixture
def two_tasks(tmp_path, rows, jsonl, parquet):
    gsm = parquet(tmp_path / "gsm.parquet", [rows(i) for i in range(6)])
    # No data_source column: the task name becomes the data source.
    math_rows = [{"prompt": f"what is {i} ?", "answer": str(i)} for i in range(2)]
    return {"gsm8k": gsm, "math": jsonl(tmp_path / "m.jsonl", math_rows)}


def test_dict_spec_builds_one_dataset_per_task(two_tasks, tokenizer):
    mix = load_dataset(two_tasks, tokenizer, **LOAD)
    assert mix.sizes == {"gsm8k": 6, "math": 2} and len(mix) == 8
    assert mix.data_sources == {"openai/gsm8k", "math"}
    assert mix.probabilities == {"gsm8k": 0.75, "math": 0.25}  # proportional to size by default
    record, _ = mix["math", 1]
    assert record.text == "what is 1 ?" and record.ground_truth == "1"


def test_default_data_source_overrides_task_name(two_tasks, tokenizer):
    mix = load_dataset(two_tasks["math"], tokenizer, default_data_source="mine", **LOAD)
    assert mix.tasks == ["m"] and mix.data_sources == {"mine"}


def test_weighted_mixture_proportions_are_seeded(two_tasks, tokenizer):
    mix = load_dataset(two_tasks, tokenizer, weights={"gsm8k": 1.0, "math": 3.0}, **LOAD)
    draws = mix.make_sampler(seed=1).next_indices(4000)
    share = Counter(task for task, _ in draws)["math"] / len(draws)
    assert abs(share - 0.75) < 0.03
    assert mix.make_sampler(seed=1).next_indices(4000) == draws
    assert mix.make_sampler(seed=2).next_indices(50) != draws[:50]
    batch = mix.next_batch(mix.make_sampler(seed=1), 4, pad_id=0)
    assert batch["prompts"].shape[0] == 4


@pytest.mark.parametrize("weights, match", [({"gsm8k": 1, "nope": 1}, "unknown tasks"),
                                            ({"gsm8k": 1}, "no weight for tasks"),
                                            ({"gsm8k": -1, "math": 1}, "non-negative")])
def test_bad_weights(two_tasks, tokenizer, weights, match):
    with pytest.raises(DataError, match=match):
        load_dataset(two_tasks, tokenizer, weights=weights, **LOAD)


def test_synthetic_spec_uses_the_registry(tokenizer, monkeypatch):
    def adder(n: int, big: bool = False) -> list[dict]:
        return [{"data_source": "adder", "prompt": [{"role": "user", "content": f"{i} + {i}"}],
                 "reward_model": {"ground_truth": str(2 * i + (100 if big else 0))}} for i in range(n)]

    monkeypatch.setitem(SYNTHETIC_TASKS, "adder", adder)
    mix = load_dataset("synthetic:adder?n=3&big=true", tokenizer, **LOAD)
    assert mix.sizes == {"adder": 3} and mix["adder", 2][0].ground_truth == "104"
    with pytest.raises(DataError, match="unknown synthetic task 'nope'.*adder"):
        load_dataset("synthetic:nope", tokenizer, **LOAD)
    with pytest.raises(DataError, match="unknown parameter 'm'; the task's parameters are n, big=False"):
        load_dataset("synthetic:adder?m=1", tokenizer, **LOAD)


def test_single_task_walks_epochs(tmp_path):
    s = MixtureSampler({"t": 5}, None, seed=0)
    first = s.next_indices(5)
    assert sorted(i for _, i in first) == list(range(5)) and s.epoch == 1
    second = s.next_indices(5)
    assert sorted(i for _, i in second) == list(range(5)) and second != first and s.epoch == 2
    ordered = MixtureSampler({"t": 3}, None, seed=0, shuffle=False)
    assert [i for _, i in ordered.next_indices(4)] == [0, 1, 2, 0]


def test_chunking_does_not_change_the_stream():
    a = MixtureSampler({"x": 7, "y": 3}, {"x": 1, "y": 1}, seed=3)
    b = MixtureSampler({"x": 7, "y": 3}, {"x": 1, "y": 1}, seed=3)
    assert a.next_indices(4) + a.next_indices(9) == b.next_indices(13)


@pytest.mark.parametrize("sizes, weights", [({"t": 7}, None), ({"x": 7, "y": 3}, {"x": 2, "y": 1})])
@pytest.mark.parametrize("before", [3, 7, 12])  # mid-epoch, exactly at an epoch boundary, after one
def test_save_restore_gives_identical_continuation(sizes, weights, before):
    s = MixtureSampler(sizes, weights, seed=11)
    s.next_indices(before)
    state = json.loads(json.dumps(s.state_dict()))  # must survive a JSON checkpoint
    expected = s.next_indices(20)
    restored = MixtureSampler(sizes, weights, seed=999)  # the checkpoint's seed wins
    restored.load_state_dict(state)
    assert restored.next_indices(20) == expected and restored.epoch == s.epoch


def test_restore_into_different_data_fails():
    state = MixtureSampler({"t": 7}, None, seed=0).state_dict()
    with pytest.raises(DataError, match="same data files"):
        MixtureSampler({"t": 8}, None, seed=0).load_state_dict(state)
