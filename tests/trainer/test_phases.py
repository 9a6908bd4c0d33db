"""The trainer's phases one by one on the local backend (tiny model, 4 prompts × 2 samples)."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from fleetrl.config import derive_plan, load_config, to_dict
from fleetrl.tracking.tracker import Tracker
from fleetrl.trainer.metric_names import is_machine_metric
from fleetrl.trainer.trainer import SEQ_KEYS, Trainer
from fleetrl.workers.messages import GenerateRequest, UpdateSpec
from fleetrl.workers.worker import Worker

COMMON = ["cluster.backend=local", "data.prompts_per_step=4", "rollout.n=2", "algorithm.micro_batch_size=8",
          "trainer.total_steps=2", "tracking.progress=false", "tracking.console=false"]


def _trainer(tmp_path: Path, *overrides: str) -> Trainer:
    cfg = load_config("examples/quickstart.yaml", [*COMMON, *overrides, f"trainer.output_dir={tmp_path}"])
    plan = derive_plan(cfg)
    trainer = Trainer(plan, Tracker(tmp_path, cfg.tracking, to_dict(cfg), cfg.trainer.name), tmp_path)
    trainer.build_groups()
    return trainer


@pytest.fixture
def on_policy(tmp_path: Path):
    # KL in the reward needs a reference; 1 mini-batch and 1 epoch: no recompute pass.
    t = _trainer(tmp_path, "algorithm.kl.placement=reward")
    yield t
    t.shutdown()
    t.tracker.close()


@pytest.fixture
def recomputed(tmp_path: Path):
    t = _trainer(tmp_path, "algorithm.kl.placement=reward", "algorithm.mini_batch_prompts=2")
    yield t
    t.shutdown()
    t.tracker.close()


def _spy_requests(trainer: Trainer) -> list[GenerateRequest]:
    group = trainer.group("rollout")
    real, seen = group.call_groups, []

    def spy(method, batch, partition, *args, **kwargs):
        seen.extend(a for a in args if isinstance(a, GenerateRequest))
        return real(method, batch, partition, *args, **kwargs)

    group.call_groups = spy  # type: ignore[method-assign]
    return seen


def _spy_updates(trainer: Trainer) -> list[tuple[list, UpdateSpec]]:
    group = trainer.group("actor")
    real, seen = group.call_parts, []

    def spy(method, parts, spec, **kwargs):
        seen.append((parts, spec))
        return real(method, parts, spec, **kwargs)

    group.call_parts = spy  # type: ignore[method-assign]
    return seen


def test_each_phase_adds_its_keys_on_policy(on_policy: Trainer):
    t = on_policy
    assert not t.plan.recompute_logprobs and t.plan.use_ref and not t.plan.use_critic
    t.progress.step, t.progress.weights_version = 3, 2
    t.group("rollout").call_all(Worker.mark_weights_version, 2)
    requests = _spy_requests(t)
    prompts = t.train_feed.next_batch(4)
    batch = t.generate(prompts)
    assert requests == [GenerateRequest(purpose="generate", step=3, temperature=1.0, min_weights_version=2)]
    assert len(batch) == 8 and batch["group"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert {"responses", "response_mask", "rollout_logprobs"} <= set(batch.tensors)
    before = set(batch.tensors)
    batch = t.score(batch)
    assert set(batch.tensors) - before == {"scores"} and "reward_stats" in batch.meta
    batch = t.logprobs(batch)
    # On-policy: only the reference pass runs; the rollout's log-probs stand for the policy's.
    assert set(batch.tensors) - before == {"scores", "ref_logprobs"}
    assert t.values(batch) is batch  # no critic: nothing to add
    batch = t.advantages(batch)
    assert set(batch.tensors) - before == {"scores", "ref_logprobs", "advantages", "returns"}
    sent = _spy_updates(t)
    metrics = t.update(batch)
    [(parts, spec)] = sent
    # On-policy: the update uses its own detached log-probs; no old_logprobs cross to the worker.
    assert spec.old_logprobs == "current" and len(spec.minis) == 1
    assert set(parts[0].tensors) == set(SEQ_KEYS) | {"advantages", "rollout_logprobs"}
    assert "train/entropy" in metrics and "train/rollout_logprob_diff_mean" in metrics
    assert "train/actor/pg_loss" in metrics and "train/actor/grad_norm" in metrics
    assert all(math.isfinite(v) for v in metrics.values())
    # the worker's peak memory since its last report (this process: the local backend), > 10 MiB with torch loaded
    assert metrics["train/memory/rss_peak_gib"] >= 0.01
    on_gpu = t.plan.pools[t.plan.roles["actor"]].uses_gpu and torch.cuda.is_available()
    assert ("train/memory/gpu_peak_allocated_gib" in metrics) == on_gpu


def test_kl_uses_rollout_logprobs_when_not_recomputed(on_policy: Trainer):
    t = on_policy
    batch = t.score(t.generate(t.train_feed.next_batch(4)))
    batch = t.logprobs(batch)
    assert "old_logprobs" not in batch
    # k3 with logp = 0 and ref = -ln 2: log r = -ln 2, r = 0.5, KL = r - 1 - log r = ln 2 - 0.5 on every token.
    shape = batch["response_mask"].shape
    batch = batch.with_tensors(rollout_logprobs=torch.zeros(shape), ref_logprobs=torch.full(shape, -math.log(2)))
    batch = t.advantages(batch)
    assert batch.meta["kl"] == pytest.approx(math.log(2) - 0.5, rel=1e-6)


def test_recompute_pass_adds_old_logprobs_and_the_kl_uses_them(recomputed: Trainer):
    t = recomputed
    assert t.plan.recompute_logprobs and t.plan.num_mini_batches == 2
    batch = t.score(t.generate(t.train_feed.next_batch(4)))
    batch = t.logprobs(batch)
    assert {"old_logprobs", "entropy", "ref_logprobs"} <= set(batch.tensors)
    shape = batch["response_mask"].shape
    # old = 0, ref = -ln 2 as above; the rollout's log-probs (here -5) must not enter the KL.
    kl_batch = batch.with_tensors(old_logprobs=torch.zeros(shape), rollout_logprobs=torch.full(shape, -5.0),
                                  ref_logprobs=torch.full(shape, -math.log(2)))
    kl_batch = t.advantages(kl_batch)
    assert kl_batch.meta["kl"] == pytest.approx(math.log(2) - 0.5, rel=1e-6)
    sent = _spy_updates(t)
    metrics = t.update(t.advantages(batch))
    # The recompute pass measured the entropy (trainer/metrics.py); the update does not report it again.
    assert "train/entropy" not in metrics and "train/actor/pg_loss" in metrics
    [(parts, spec)] = sent
    assert spec.old_logprobs == "recomputed" and len(spec.minis) == 2
    assert set(parts[0].tensors) == set(SEQ_KEYS) | {"advantages", "rollout_logprobs", "old_logprobs"}


def test_dynamic_sampling_refills_a_sync_step_with_informative_groups(tmp_path: Path):
    # 4 prompts x 2 samples a round, scores set per round: round 1 keeps groups 0 and 3 (their two scores differ)
    # and drops 1 and 2; round 2 keeps 1 and 2 and drops 0 and 3. Four informative groups after 2 of 3 rounds.
    t = _trainer(tmp_path, "algorithm.dynamic_sampling.enabled=true", "algorithm.dynamic_sampling.max_rounds=3")
    try:
        rounds = iter([[0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0]])
        t.scorer.score = lambda batch, texts=None: (torch.tensor(next(rounds)), {})  # type: ignore[method-assign]
        generated, real_generate = [], t.generate
        t.generate = lambda prompts: generated.append(real_generate(prompts)) or generated[-1]  # type: ignore
        batch = t.rollouts()
        assert len(generated) == 2 and next(rounds, None) is None  # exactly two rounds ran
        assert batch.meta["dynamic_sampling"] == {"dynamic_sampling/rounds": 2.0,
                                                  "dynamic_sampling/dropped_groups": 4.0,
                                                  "dynamic_sampling/shortfall_groups": 0.0}
        assert batch["scores"].tolist() == [0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0]
        assert batch["group"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
        r1, r2 = (list(g["ground_truth"]) for g in generated)
        assert list(batch["ground_truth"]) == [r1[0], r1[1], r1[6], r1[7], r2[2], r2[3], r2[4], r2[5]]
    finally:
        t.shutdown()
        t.tracker.close()


def test_generate_reports_its_parts_with_offload_and_fsdp2(tmp_path: Path):
    # One shard of FSDP2 on gloo with the optimiser offloaded: a step's generate phase holds the optimiser's trip to
    # the host and back, the unshard and the rollout, and each is logged under train/time/generate/ (a machine
    # metric) so that a slow phase can be taken apart (bench/e2e.py's generate_parts_s).
    t = _trainer(tmp_path, "actor.sharding=fsdp2", "actor.offload_optimizer=true")
    try:
        metrics = t.fit()
    finally:
        t.shutdown()
        t.tracker.close()
    parts = {k.removeprefix("train/time/generate/"): v for k, v in metrics.items()
             if k.startswith("train/time/generate/")}
    assert set(parts) == {"offload_optimizer", "onload_optimizer", "unshard", "rollout"}
    assert all(v >= 0 for v in parts.values())
    # the parts are inside the phase, and the unshard inside the rollout
    assert parts["offload_optimizer"] + parts["rollout"] + parts["onload_optimizer"] <= metrics["train/time/generate"]
    assert parts["unshard"] <= parts["rollout"]
    assert all(is_machine_metric(f"train/time/generate/{k}") for k in parts)


def test_generate_reports_only_the_rollout_without_offload_or_sharding(on_policy: Trainer):
    batch = on_policy.generate(on_policy.train_feed.next_batch(4))
    assert set(batch.meta["timing"]) == {"generate/rollout"}


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="per-step peaks reset through Linux's clear_refs")
def test_a_rank_local_step_reports_the_peak_its_update_reached(tmp_path: Path, monkeypatch):
    """The step's train/memory/rss_peak_gib covers a 256 MiB buffer the actor's update held and freed: the peak is
    read (and reset) once per update report. Read twice, the second read reset by the first showed only the RSS
    after the update (the SmolLM2 LoRA job logged 1.37 GiB a step while the process sat at 1.9-2.1 GiB)."""
    from fleetrl.workers.actor import ActorComponent
    from fleetrl.workers.memory import rss_peak_gib

    real_update = ActorComponent.update

    def update_holding_256_mib(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        buffer = torch.ones(2**26)  # 64 Mi float32 = 256 MiB, written so its pages are resident
        del buffer
        return real_update(self, *args, **kwargs)

    monkeypatch.setattr(ActorComponent, "update", update_holding_256_mib)
    t = _trainer(tmp_path)
    try:
        assert t.local is not None  # the rank-local step is the default
        rss_peak_gib()  # reset: the peak from here on
        before = Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0]
        metrics, _ = t.run_step()
        assert metrics["train/memory/rss_peak_gib"] >= int(before) / 2**20 + 0.24
    finally:
        t.shutdown()
        t.tracker.close()


def test_the_step_check_fails_a_jump_not_a_slow_drift():
    """source=step: the baseline is the largest gap of the previous 10 steps. A gap drifting up by 0.004 a step (the
    CPU SmolLM2 LoRA job's bf16 merge) never exceeds it + 0.05; a step whose gap is 0.06 above the window's largest
    is an error naming the sync's version (the step's - 1) and the step."""
    from types import SimpleNamespace

    from fleetrl.config.schema import SyncCheckConfig
    from fleetrl.engines.sync_check import SyncCheckError
    from fleetrl.trainer.progress import Progress

    events = []
    t = Trainer.__new__(Trainer)
    t.plan = SimpleNamespace(step_sync_check=True, rollout_colocated=True)
    t.cfg = SimpleNamespace(rollout=SimpleNamespace(sync_check=SyncCheckConfig()))
    t.progress, t.recent_gaps, t.sync_gap = Progress(), __import__("collections").deque(maxlen=10), None
    t.tracker = SimpleNamespace(event=lambda step, name, **kw: events.append((step, name, kw)))
    for step in range(1, 41):  # 0.037 -> 0.193
        t.progress.step, t.progress.weights_version = step, step
        t.check_step_gap({"train/rollout_logprob_diff_mean": 0.037 + 0.004 * (step - 1)})
    assert t.progress.sync_baseline == pytest.approx(0.193) and not events
    t.progress.step, t.progress.weights_version = 41, 41
    with pytest.raises(SyncCheckError, match="to version 40, checked on step 41's samples") as e:
        t.check_step_gap({"train/rollout_logprob_diff_mean": 0.193 + 0.06})
    assert e.value.version == 40 and events[0][:2] == (41, "sync_check_failed")
