"""trainer.partial_rollouts through real Ray workers (docs/async.md, Partial rollouts): every trained token's recorded
version is the one the rollout engine held when it sampled that token, as the worker itself logged it (the
FLEETRL_SEGMENT_LOG hook: the engine's version and a fingerprint of the weights it decoded with, matched to the
actor's published weights), and no trained token is more than max_staleness versions behind; GRPO still learns
with max_staleness 2 and partial rollouts, to the synchronous test's thresholds."""
from __future__ import annotations

import json
import time
from collections import defaultdict

import pytest
import ray
import torch

from fleetrl.cluster.store_codec import from_store
from fleetrl.config import derive_plan, load_config
from fleetrl.tracking.tracker import Tracker
from fleetrl.trainer.pipeline import AsyncRollouts
from fleetrl.trainer.schedule import token_bound_holds
from fleetrl.trainer.trainer import Trainer
from tests.integration.helpers import read_metrics, train_run, val_curve
from tests.integration.test_async import SHORT, SPLIT

PARTIAL = ("trainer.mode=async", "trainer.partial_rollouts=true", "algorithm.rollout_correction.mode=tis")


def _fingerprint(state: dict[str, torch.Tensor]) -> float:
    """As workers/partial.py weights_fingerprint computes it on the engine's model."""
    return float(sum(t.double().sum() for t in state.values() if t.is_floating_point()))


@pytest.mark.slow
def test_each_token_records_the_version_that_sampled_it(tmp_path, ray_local, monkeypatch):
    log = tmp_path / "segments.jsonl"
    # k = 1, one token per segment (max_new_tokens 4 / 4), and a slow rollout (0.25 s before each continued segment)
    # so that versions are published while a call is decoding and samples span two versions.
    overrides = [*SHORT, *SPLIT, *PARTIAL, "trainer.max_staleness=1", "trainer.total_steps=5",
                 f"cluster.env={{FLEETRL_SEGMENT_LOG: '{log}', FLEETRL_SEGMENT_DELAY_S: '0.25'}}",
                 "tracking.console=false", "tracking.progress=false", f"trainer.output_dir={tmp_path}"]
    cfg = load_config("examples/quickstart.yaml", overrides)
    plan = derive_plan(cfg)
    assert plan.pipeline.segment_tokens == 1
    published: dict[int, float] = {}  # version -> fingerprint of what the actor published (the ground truth)
    real_publish = AsyncRollouts.publish

    def publish(self, version: int) -> None:
        real_publish(self, version)
        published[version] = _fingerprint(from_store(ray.get(self.weights[0])))

    monkeypatch.setattr(AsyncRollouts, "publish", publish)
    trainer = Trainer(plan, Tracker(tmp_path, cfg.tracking, {}, "partial"), tmp_path)
    seen: list[tuple[int, torch.Tensor, list[list[int]], list[list[int]]]] = []
    real = trainer.advantages

    def spy(batch):
        mask = batch["response_mask"].bool()
        prompts = [batch["prompts"][b][batch["prompt_mask"][b].bool()].tolist() for b in range(len(batch))]
        responses = [batch["responses"][b][mask[b]].tolist() for b in range(len(batch))]
        seen.append((trainer.progress.weights_version, batch["token_versions"].clone(), prompts, responses))
        return real(batch)

    trainer.advantages = spy  # type: ignore[method-assign]
    t0 = time.monotonic()
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
        trainer.tracker.close()
    # What the rollout worker logged, per (prompt, tokens before the segment): the version and weights it decoded
    # with and the tokens that segment added.
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    by_prompt: dict[tuple, list[tuple[int, list[int], list[int]]]] = defaultdict(list)
    fingerprints: dict[int, set[float]] = defaultdict(set)
    for e in entries:
        fingerprints[e["version"]].add(round(e["fingerprint"], 6))
        for row in e["rows"]:
            by_prompt[tuple(row["prompt"])].append((e["version"], row["before"], row["new"]))
    # The version an engine reported is the weights it held: one fingerprint per version, the actor's for v >= 1.
    assert all(len(f) == 1 for f in fingerprints.values()), fingerprints
    for v, (fp,) in fingerprints.items():
        if v >= 1:
            assert fp == pytest.approx(published[v], rel=1e-9, abs=1e-6), (v, fp, published[v])
    assert len({next(iter(f)) for f in fingerprints.values()}) == len(fingerprints)  # versions differ in weights

    trained = [t for t, *_ in seen]
    assert trained == [0, 1, 2, 3, 4]
    tokens_checked = mixed = 0
    for step, (_, versions, prompts, responses) in enumerate(seen, start=1):
        for b, (prompt, response) in enumerate(zip(prompts, responses)):
            logged: list[set[int]] = [set() for _ in response]
            for version, before, new in by_prompt[tuple(prompt)]:
                k = len(before)
                if response[:k] == before and response[k:k + len(new)] == new:
                    for pos in range(k, k + len(new)):
                        logged[pos].add(version)
            assert all(len(s) == 1 for s in logged), f"step {step} sample {b}: logged versions {logged}"
            recorded = versions[b, :len(response)].tolist()
            assert recorded == [next(iter(s)) for s in logged], f"step {step} sample {b}: {recorded} vs {logged}"
            tokens_checked += len(response)
            mixed += len(set(recorded)) > 1
    token_versions = [[versions[b, :len(r)].tolist() for b, r in enumerate(rs)] for _, versions, _, rs in seen]
    assert token_bound_holds(trained, token_versions, 1)
    assert mixed > 0, "no sample spanned two versions: the test did not exercise a continuation on new weights"
    steps = [r for r in read_metrics(tmp_path) if "train/async/token_staleness_max" in r]
    assert len(steps) == 5 and max(r["train/async/token_staleness_max"] for r in steps) <= 1
    assert sum(r["train/async/continued_frac"] for r in steps) > 0
    assert sum(r["train/async/mixed_version_frac"] for r in steps) > 0
    print(f"partial rollouts: {tokens_checked} tokens checked, {mixed} samples over two versions, "
          f"{time.monotonic() - t0:.0f}s")


@pytest.mark.slow
def test_grpo_learns_with_staleness_two_and_partial_rollouts(tmp_path, ray_local):
    # The synchronous GRPO budget and thresholds of test_learning.py (80 steps, < 20% -> > 80%). The fast engine
    # (the hf one is the other test's): one-token segments, so nearly every sample is continued (41 s on 2 cores;
    # 82 s with the hf engine's generate and log-prob pass per segment).
    t0 = time.monotonic()
    records = train_run("examples/quickstart.yaml", tmp_path / "learn", *SPLIT, *PARTIAL, "trainer.total_steps=80",
                        "trainer.val_every=20", "trainer.max_staleness=2", "rollout.engine=fast")
    curve = val_curve(records)
    assert curve[0] < 0.2, f"initial held-out success {curve[0]} should start below 20%"
    assert curve[-1] > 0.8, f"held-out success curve {curve} did not pass 80%"
    steps = [r for r in records if "train/async/token_staleness_max" in r]
    assert max(r["train/async/token_staleness_max"] for r in steps) <= 2
    print(f"partial-rollout GRPO learning: {time.monotonic() - t0:.0f}s, curve {curve}, continued "
          f"{sum(r['train/async/continued_frac'] for r in steps) / len(steps):.2f}")
