"""WorkerGroup with backend=local: real tiny Workers in this process (no Ray), the same call paths as on Ray."""
from __future__ import annotations

import pytest
import torch

from fleetrl.batch import Batch
from fleetrl.cluster.group import WorkerGroup
from fleetrl.config import derive_plan, load_config
from fleetrl.trainer.feed import PromptFeed
from fleetrl.workers.messages import GenerateRequest
from fleetrl.workers.worker import Worker

OVERRIDES = ["cluster.backend=local", "data.prompts_per_step=4", "rollout.n=2", "algorithm.micro_batch_size=8"]


@pytest.fixture(scope="module")
def setup():
    plan = derive_plan(load_config("examples/quickstart.yaml", OVERRIDES))
    group = WorkerGroup(plan, "main", backend="local")
    feed = PromptFeed.for_train(plan)
    yield plan, group, feed
    group.shutdown()


def _req(version: int = 0) -> GenerateRequest:
    return GenerateRequest(purpose="generate", step=0, temperature=1.0, min_weights_version=version)


def _sequences(group: WorkerGroup, feed: PromptFeed) -> Batch:
    prompts = feed.next_batch(4)
    out = group.call_split(Worker.generate, prompts.pick("prompts", "prompt_mask"), _req())
    return prompts.pick("prompts", "prompt_mask").update(out)


def test_call_split_returns_results_in_input_order(setup):
    plan, group, feed = setup
    seq = _sequences(group, feed)
    one = group.call_split(Worker.compute_logprobs, seq)["old_logprobs"]
    assert one.shape == seq["response_mask"].shape
    # A second real worker with the same seed holds the same weights; the group now splits the 4 rows
    # balanced by tokens over 2 workers and must gather them back in the input order.
    twin = Worker(group._ctx(0))
    twin.build()
    workers, group.workers, group.world_size = group.workers, [group.workers[0], twin], 2
    try:
        _, index = seq.split_balanced(2)
        # Guard: the split interleaves rows (here [[0, 2], [1, 3]]), so a plain concatenation would be misordered.
        assert [i for ix in index for i in ix.tolist()] != [0, 1, 2, 3]
        two = group.call_split(Worker.compute_logprobs, seq)["old_logprobs"]
    finally:
        group.workers, group.world_size = workers, 1
    mask = seq["response_mask"].bool()
    assert torch.allclose(two[mask], one[mask], atol=1e-5)
    # The rows differ from each other, so a permutation would not pass the comparison above.
    rows = [tuple(one[i][mask[i]].tolist()) for i in range(len(seq))]
    assert len(set(rows)) == len(rows)


def test_call_all_and_call_parts_pass_extra_args(setup):
    _, group, feed = setup
    assert group.call_all(Worker.mark_weights_version, 5) == [None]
    assert group.call_all(Worker.weights_version) == [5]
    prompts = feed.next_batch(2).pick("prompts", "prompt_mask")
    [out] = group.call_parts(Worker.generate, [prompts], _req(version=5))
    assert len(out) == 2 and {"responses", "response_mask", "rollout_logprobs"} <= set(out.tensors)
    group.call_all(Worker.mark_weights_version, 0)


def test_call_parts_needs_one_part_per_rank(setup):
    _, group, feed = setup
    prompts = feed.next_batch(2).pick("prompts", "prompt_mask")
    with pytest.raises(AssertionError, match=r"\(2, 1\)"):
        group.call_parts(Worker.generate, [prompts, prompts], _req())


def test_a_failing_verb_raises_its_own_error(setup):
    _, group, feed = setup
    with pytest.raises(RuntimeError, match=r"pool 'main' hosts roles \['actor', 'rollout'\], not 'critic'"):
        group.call_all(Worker.compute_values, feed.next_batch(2))
    # A generate call that needs newer weights than the engine holds (a sync that did not arrive).
    with pytest.raises(RuntimeError, match="holds weights version 0 but the step needs 3: weight sync did not arrive"):
        group.call_split(Worker.generate, feed.next_batch(2).pick("prompts", "prompt_mask"), _req(version=3))


def test_overhead_is_taken_once(setup):
    _, group, _ = setup
    group.call_all(Worker.weights_version)
    assert group.take_overhead() > 0.0  # the call's time outside the worker method was counted
    assert group.take_overhead() == 0.0  # reset by the first take
