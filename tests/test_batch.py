import numpy as np
import pytest
import torch

from fleetrl.batch import Batch, balanced_partition


def _batch(prompt_lens, resp_lens, P=4, R=3):
    B = len(prompt_lens)
    pm = torch.zeros(B, P, dtype=torch.long)
    rm = torch.zeros(B, R, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_lens, resp_lens)):
        pm[i, P - p:] = 1
        rm[i, :r] = 1
    return Batch({"prompts": pm * (torch.arange(B)[:, None] + 1), "prompt_mask": pm,
                  "responses": rm * 7, "response_mask": rm, "scores": torch.arange(B, dtype=torch.float)},
                 {"uid": [f"u{i}" for i in range(B)]})


def test_repeat_interleave_keeps_groups_contiguous():
    b = _batch([1, 2], [1, 1]).repeat_interleave(3)
    assert list(b["uid"]) == ["u0", "u0", "u0", "u1", "u1", "u1"]
    assert b["scores"].tolist() == [0, 0, 0, 1, 1, 1]


def test_select_and_chunk():
    b = _batch([1, 2, 3, 4], [1, 1, 1, 1])
    assert list(b.select([3, 0])["uid"]) == ["u3", "u0"]
    parts = b.chunk(2)
    assert [list(p["uid"]) for p in parts] == [["u0", "u1"], ["u2", "u3"]]
    with pytest.raises(ValueError, match="equal chunks"):
        b.chunk(3)


def test_concat_repads_prompts_left_and_responses_right():
    a = _batch([2], [1], P=2, R=1)
    b = _batch([3], [3], P=4, R=3)
    c = Batch.concat([a, b])
    # a's prompt [1,1] padded on the left to width 4: [0,0,1,1]; its response [7] padded right: [7,0,0]
    assert c["prompt_mask"].tolist() == [[0, 0, 1, 1], [0, 1, 1, 1]]
    assert c["responses"].tolist() == [[7, 0, 0], [7, 7, 7]]
    assert c["response_mask"].tolist() == [[1, 0, 0], [1, 1, 1]]


def test_balanced_partition_hand_computed():
    # weights 9,8,2,1 into 2 equal-count parts: LPT puts 9 -> p0, 8 -> p1, 2 -> p1 (load 8 < 9), 1 -> p0
    assert balanced_partition([9, 8, 2, 1], 2) == [[0, 3], [1, 2]]
    with pytest.raises(ValueError, match="multiple of 3"):
        balanced_partition([1, 2, 3, 4], 3)


def test_split_balanced_then_gather_restores_order():
    b = _batch([4, 4, 1, 1, 2, 3], [3, 3, 1, 1, 2, 1], P=4, R=3)
    parts, index = b.split_balanced(2)
    loads = [int(p.token_counts().sum()) for p in parts]
    assert abs(loads[0] - loads[1]) <= 2 and sum(loads) == int(b.token_counts().sum())
    back = Batch.gather(parts, index)
    assert list(back["uid"]) == list(b["uid"])
    assert torch.equal(back["prompts"], b["prompts"])


def test_inconsistent_sizes_rejected():
    with pytest.raises(ValueError, match="inconsistent"):
        Batch({"a": torch.zeros(2)}, {"b": np.array([1, 2, 3], dtype=object)})
