"""The log-prob passes under FSDP2 (workers/actor.py batched_logprobs): a rank with fewer micro-batches than another
re-cuts its rows into as many instead of running a repeat, and the log-probs are those of its own cut."""
from __future__ import annotations

import torch

from fleetrl.batch import Batch
from fleetrl.models.tiny import build_tiny_model, build_tiny_tokenizer
from fleetrl.workers.actor import batched_logprobs


class _PeerHasMore:
    """A TrainingEngine stand-in for a sharded rank whose peer made `extra` more micro-batches (the count
    `same_count_on_every_rank` agrees on); records what each pass ran."""

    def __init__(self, extra: int) -> None:
        self.extra, self.passes = extra, []

    def aligned(self, mbs, split=None):  # noqa: ANN001, ANN201
        cut = split(len(mbs) + self.extra) if split is not None else mbs
        pairs = [(mb, True) for mb in cut] + [(cut[-1], False)] * (len(mbs) + self.extra - len(cut))
        self.passes = [(len(mb), real) for mb, real in pairs]
        return pairs


def _batch(rows: int = 6) -> Batch:
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 30, (rows, 5), generator=g)
    responses = torch.randint(3, 30, (rows, 4), generator=g)
    return Batch({"prompts": prompts, "prompt_mask": torch.ones_like(prompts),
                  "responses": responses, "response_mask": torch.ones_like(responses)})


def test_a_rank_with_fewer_micro_batches_recuts_its_rows_and_runs_no_repeat():
    torch.manual_seed(0)
    model = build_tiny_model(build_tiny_tokenizer(), seed=1)
    batch = _batch()
    plain, _ = batched_logprobs(model, batch, micro=3, temperature=1.0, chunk=None, entropy=False)
    engine = _PeerHasMore(extra=1)  # its own rows make 2 micro-batches of 3; the peer made 3
    recut, _ = batched_logprobs(model, batch, micro=3, temperature=1.0, chunk=None, entropy=False, engine=engine)
    assert engine.passes == [(2, True), (2, True), (2, True)]  # every row once, no zero-work repeat
    torch.testing.assert_close(recut, plain, atol=1e-5, rtol=0)
