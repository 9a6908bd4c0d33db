"""Partial rollouts: the per-token staleness bound where the schedule decides what a step takes (Window.take on the
chunk's oldest token), the pipeline's per-token numbers (trainer/pipeline.py token_metrics), and the Plan's checks.
Hand-computed expectations."""
from __future__ import annotations

import pytest
import torch

from fleetrl.batch import Batch
from fleetrl.config import derive_plan, load_config
from fleetrl.config.async_plan import AsyncPlan
from fleetrl.config.load import ConfigError
from fleetrl.trainer.pipeline import oldest_token_version, token_metrics
from fleetrl.trainer.schedule import Window, token_bound_holds

SPLIT = ("cluster.pools={train: {cpus_per_worker: 0.5}, gen: {cpus_per_worker: 0.5}}",
         "cluster.roles={actor: train, rollout: gen}")


def _batch(versions: list[list[int]], lengths: list[int], segments: list[int] | None = None) -> Batch:
    mask = torch.tensor([[1] * n + [0] * (len(versions[0]) - n) for n in lengths])
    tv = torch.tensor(versions) * mask
    first = tv[:, 0]
    tensors = {"response_mask": mask, "token_versions": tv, "weights_version": first}
    if segments is not None:
        tensors["segments"] = torch.tensor(segments)
    return Batch(tensors)


def test_the_bound_is_per_token():
    # step 1 trains version 0, step 2 version 1, step 3 version 2; k = 1
    ok = [[[0, 0]], [[0, 1], [1]], [[1, 2, 2]]]
    assert token_bound_holds([0, 1, 2], ok, 1)
    # one token of step 3 sampled at version 0: 2 versions behind, though the sample's other tokens are fresh
    assert not token_bound_holds([0, 1, 2], [[[0, 0]], [[0, 1]], [[0, 2, 2]]], 1)
    # a token newer than the policy trained cannot exist (the rollout only gets published versions)
    assert not token_bound_holds([0, 1, 2], [[[0, 0]], [[2]], [[2]]], 1)


def test_the_oldest_token_decides():
    b = _batch([[1, 2, 7], [2, 2, 2]], lengths=[2, 3])  # 7 is past sample 0's response: padding
    assert oldest_token_version(b) == 1
    b = _batch([[3, 3], [2, 3]], lengths=[2, 2])
    assert oldest_token_version(b) == 2


def test_drop_takes_the_oldest_token_not_the_newest():
    plan = AsyncPlan(max_staleness=1, stale="drop", groups_per_step=1, chunk_groups=1, window_groups=2,
                     max_chunks_per_step=1)
    w = Window(plan)
    first, second = w.fill(1)  # two chunks submitted at version 1; their calls later took versions 2 and 3 too
    # Step 4 trains version 3. Chunk 0's samples: tokens of versions 1, 2, 3: its oldest is 2 versions behind.
    assert not w.take(first, oldest_token_version(_batch([[1, 2, 3], [3, 3, 3]], [3, 3])), trained_version=3)
    assert w.dropped_groups == 1
    # Chunk 1's oldest token is version 2 (its first segment ran after version 2 was installed): 1 behind, kept.
    assert w.take(second, oldest_token_version(_batch([[2, 3, 3], [2, 2, 3]], [3, 2])), trained_version=3)


def test_hold_asserts_the_bound_on_tokens():
    plan = AsyncPlan(max_staleness=0, stale="hold", groups_per_step=1, chunk_groups=1, window_groups=1,
                     max_chunks_per_step=1)
    w = Window(plan)
    (chunk,) = w.fill(2)
    with pytest.raises(AssertionError, match="staleness above max_staleness=0"):
        w.take(chunk, oldest_token_version(_batch([[1, 2]], [2])), trained_version=2)


def test_token_metrics():
    # trained version 3, k = 2. Tokens: sample 0 [1, 2, 3] (3 segments), sample 1 [3, 3] (1), sample 2 [2] (1).
    b = _batch([[1, 2, 3, 0], [3, 3, 0, 0], [2, 0, 0, 0]], lengths=[3, 2, 1], segments=[3, 1, 1])
    m = token_metrics(b, trained_version=3, max_staleness=2)
    # staleness per token: 2, 1, 0 | 0, 0 | 1 -> mean 4/6, max 2, histogram 0: 3, 1: 2, 2: 1
    assert m["async/token_staleness_mean"] == pytest.approx(4 / 6)
    assert m["async/token_staleness_max"] == 2.0
    assert [m[f"async/token_staleness_count/{j}"] for j in range(3)] == [3.0, 2.0, 1.0]
    assert m["async/mixed_version_frac"] == pytest.approx(1 / 3)  # only sample 0 spans versions
    assert m["async/continued_frac"] == pytest.approx(1 / 3)  # only sample 0 was re-prefilled


def _plan(*overrides: str):
    return derive_plan(load_config(None, ["algorithm.micro_batch_size=1", "data.prompts_per_step=4", "rollout.n=2",
                                          "rollout.max_new_tokens=10", *overrides]))


def test_plan_derives_the_segment_budget():
    base = _plan(*SPLIT, "trainer.mode=async")
    assert base.pipeline.segment_tokens is None and "partial_segment_tokens" not in base.summary()["pipeline"]
    p = _plan(*SPLIT, "trainer.mode=async", "trainer.partial_rollouts=true")
    assert p.pipeline.segment_tokens == 3  # ceil(10 / 4)
    assert p.summary()["pipeline"]["partial_segment_tokens"] == 3
    # a segment is sized for its largest budget: the engine gets segment_tokens more positions
    assert p.rollout.max_seq_len == base.rollout.max_seq_len + 3
    assert _plan(*SPLIT, "trainer.mode=async", "trainer.partial_rollouts=true",
                 "trainer.partial_segment_tokens=10").pipeline.segment_tokens == 10


@pytest.mark.parametrize("overrides, message", [
    ((), r"trainer.partial_rollouts=true .* only trainer.mode=async publishes; set trainer.mode=async"),
    ((*SPLIT, "trainer.mode=async", "rollout.engine=vllm"),
     r"trainer.partial_rollouts=true .* rollout.engine=vllm does not; set rollout.engine=fast"),
    ((*SPLIT, "trainer.mode=async", "trainer.partial_segment_tokens=0"),
     r"trainer.partial_segment_tokens=0 must be in 1..rollout.max_new_tokens=10"),
])
def test_plan_refuses(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _plan("trainer.partial_rollouts=true", *overrides)
