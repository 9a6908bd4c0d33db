"""trainer.mode=async: the rollout pool generates the next max_staleness steps while the actor trains this one
(docs/async.md). The Trainer stays the one controller: `rollouts()` takes its batch from here and `sync()`
publishes here; the bookkeeping (what may start, what a step takes, what is too stale) is trainer/schedule.py.

Each generate call ("chunk") carries chunk_groups whole GRPO groups to one rollout worker, tagged with the
weights version published when it was submitted; results are scored as they arrive, so reward scoring overlaps
generation. Weights travel through the object store (trainer.async_weights=store): actor rank 0 puts its state
once per version (the actor never waits for a rollout worker to reach a collective), and each chunk's call installs
the version it is tagged with before generating, queued behind the generation the worker is running
(cluster/group.py `generate_at`). Streamed (async_weights=bus): actor rank 0 broadcasts each version to every
rollout worker, which receives it beside its decoding into a staging copy its engine loop installs between two
decode rounds (cluster/group.py `bus_offer`); the publish returns once every worker holds it.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from fleetrl.batch import Batch
from fleetrl.cluster.group import WorkerGroup, _RayWorker
from fleetrl.cluster.stream import Stream
from fleetrl.cluster.weight_sync import broadcast_weights
from fleetrl.config.plan import Plan
from fleetrl.trainer.dynamic import fill_informative
from fleetrl.trainer.feed import PromptFeed
from fleetrl.trainer.schedule import Chunk, PromptLedger, Window
from fleetrl.workers.episodes import generate_keys
from fleetrl.workers.messages import GenerateRequest


class AsyncRollouts:
    def __init__(self, plan: Plan, rollout: WorkerGroup, actor: WorkerGroup, feed: PromptFeed,
                 score: Callable[[Batch], Batch]) -> None:
        assert plan.pipeline is not None
        self.plan, self.cfg, self.p = plan, plan.config, plan.pipeline
        self.rollout, self.actor, self.feed, self.score = rollout, actor, feed, score
        self.window = Window(self.p)
        self.stream = Stream(rollout)
        self.weights: list[Any] = []  # [ObjectRef] of the latest published state; [] = the engines' initial weights
        self.version = 0
        self.started = False
        self.refs: dict[int, Any] = {}  # seq -> ref of the running call
        self.ledger = PromptLedger()  # the prompts of the chunks no step has taken yet (a checkpoint saves them)
        self.resume_points: dict[int, dict] = {}  # seq -> sampler state before its prompts were drawn
        self.restored_point: dict | None = None  # the resumed checkpoint's resume point (its plain sampler state)
        self.pending_prompts: dict[int, Batch] = {}  # seq -> the prompts of the running call
        self.finished: dict[int, Batch] = {}  # seq -> scored result, not yet taken
        self.order: list[int] = []  # seqs of `finished`, in the order they finished
        self.dropped_samples = 0
        self.rollout_idle_s = 0.0  # gaps between a rollout worker's calls, summed over workers, since last metrics

    # ----------------------------------------------------------------------------------------- publish
    def publish(self, version: int) -> None:
        """After the actor's update: its weights to the rollout pool (the bus or the object store), then generation
        up to the window at the new version. Version 0 of a fresh run needs no copy (both pools built the same
        initial weights)."""
        if self.p.weights == "bus":  # received beside the decoding and offered by the time this returns
            broadcast_weights(self.actor, self.rollout, version, self.cfg.cluster.init_timeout_s, beside_decode=True)
        else:
            self.actor.call_all(_RayWorker.stage_weights)
            self.weights = [r for refs in self.actor.call_all(_RayWorker.put_weights) for r in refs]
            if self.p.segment_tokens is not None or self.p.stream:
                # partial rollouts: running generations take it at their next segment; streamed: between decode rounds
                self.rollout.call_all(_RayWorker.offer_weights, self.weights, version)
        self.version = version
        self._fill()

    def load_engines(self) -> None:
        """Every rollout engine on the current version (before validation), queued behind running generations."""
        refs = [self.stream.submit(r, _RayWorker.load_published, self.weights, self.version)
                for r in range(self.rollout.world_size)]
        self._wait_all(refs)

    def _fill(self) -> None:
        self.started = True
        for chunk in self.window.fill(self.version):
            self._submit(chunk)

    def _draw(self, chunk: Chunk) -> list[tuple[str, int]]:
        """The chunk's prompts: those a checkpoint handed back first, then the sampler's next. Notes the resume
        point before them (prompts handed back were drawn before the restored sampler's state: the checkpoint's)."""
        self.resume_points[chunk.seq] = self.restored_point if self.ledger.requeued else self.feed.sampler.state_dict()
        return self.ledger.draw(chunk.seq, chunk.groups, self.feed.sampler.next_indices)

    def _submit(self, chunk: Chunk) -> None:
        prompts = self.feed.collate(self._draw(chunk))
        n = self.cfg.rollout.n
        batch = prompts.repeat_interleave(n)
        batch.tensors["group"] = torch.arange(len(prompts)).repeat_interleave(n)
        per_step = self.p.chunks_per_step
        # k = 0 with one chunk per step draws exactly the seeds of synchronous mode: (step, rank 0).
        req = GenerateRequest(purpose="generate", step=chunk.seq // per_step, seed_slot=chunk.seq % per_step,
                              temperature=self.cfg.rollout.temperature, min_weights_version=chunk.version,
                              segment_tokens=self.p.segment_tokens)
        rank = chunk.seq % self.rollout.world_size
        gen = batch.pick(*generate_keys(self.cfg.rollout))
        self.refs[chunk.seq] = self.stream.submit(rank, _RayWorker.generate_at, self.weights, chunk.version, gen, req)
        self.pending_prompts[chunk.seq] = batch

    # ----------------------------------------------------------------------------------------- consume
    def next_batch(self, trained_version: int) -> Batch:
        """The step's P groups: chunks taken as trainer/schedule.py says, scored, filtered (dynamic sampling)."""
        if not self.started:
            self._fill()
        taken = [self._take(trained_version)]
        ds = self.cfg.algorithm.dynamic_sampling
        if not ds.enabled:
            while len(taken) < self.p.chunks_per_step:
                taken.append(self._take(trained_version))
            batch = _concat(taken)
            batch.tensors["group"] = torch.arange(self.p.groups_per_step).repeat_interleave(self.cfg.rollout.n)
            return batch
        first = _concat(taken)
        more = lambda: self._take(trained_version)  # noqa: E731
        batch, stats = fill_informative(first, more, groups=self.p.groups_per_step, n=self.cfg.rollout.n,
                                        max_rounds=self.p.max_chunks_per_step)
        batch.meta["dynamic_sampling"] = stats
        return batch

    def _take(self, trained_version: int) -> Batch:
        """The next chunk the step may train on (stale ones dropped on the way under stale=drop)."""
        while True:
            if not self.window.outstanding:
                chunk = self.window.refill(self.version)  # dynamic sampling ran the window dry
                assert chunk is not None
                self._submit(chunk)
            chunk = self.window.pick(self.order)
            while chunk is None:
                self._collect()
                chunk = self.window.pick(self.order)
            self.order.remove(chunk.seq)
            batch = self.finished.pop(chunk.seq)
            self.resume_points.pop(chunk.seq)
            self.ledger.taken(chunk.seq)
            if self.window.take(chunk, oldest_token_version(batch), trained_version):
                return batch
            self.dropped_samples += len(batch)

    def _collect(self) -> None:
        """Waits for at least one running chunk; scores each as it arrives."""
        by_ref = {ref: seq for seq, ref in self.refs.items()}
        for ref, out in self.stream.wait(list(by_ref)).items():
            seq = by_ref[ref]
            del self.refs[seq]
            self.rollout_idle_s += out.meta.pop("rollout_idle_s", 0.0)
            self.finished[seq] = self.score(self.pending_prompts.pop(seq).update(out))
            self.order.append(seq)

    def _wait_all(self, refs: list[Any]) -> None:
        left = set(refs)
        while left:
            left -= set(self.stream.wait(list(left)))

    # ------------------------------------------------------------------------------------------- state
    def resume_point(self) -> dict:
        """The sampler state before the oldest prompts no step has taken yet: what a synchronous run resumed from
        this checkpoint draws from (it draws them again, and under `drop` a chunk taken out of order twice)."""
        if self.resume_points:
            return self.resume_points[min(self.resume_points)]
        if self.ledger.requeued:
            return self.restored_point
        return self.feed.sampler.state_dict()

    def sampler_state(self) -> "PipelineSampler":
        return PipelineSampler(self)

    def checkpoint_state(self) -> dict:
        """The `sampler` entry of an async checkpoint (docs/async.md, Resume): the resume point, a plain sampler
        state that any run can load, and under `pipeline` what an async run resumes exactly from: the prompts no
        step has taken yet (in flight or finished, oldest first), the sampler after its last draw, and the
        submission number of the oldest untaken chunk (its generation seeds)."""
        seq = min(self.ledger.chunks, default=self.window.next_seq)
        untaken = [[task, index] for task, index in self.ledger.untaken()]
        return {**self.resume_point(),
                "pipeline": {"untaken": untaken, "sampler": self.feed.sampler.state_dict(), "seq": seq}}

    def restore(self, state: dict) -> None:
        """Loads a checkpoint's `sampler` entry before the first submission. A checkpoint without the `pipeline`
        part (a synchronous run's, or an older async one's) resumes from its resume point."""
        assert not self.started, "a checkpoint is restored before generation starts"
        pipe = state.get("pipeline")
        if pipe is None:
            self.feed.sampler.load_state_dict(state)
            return
        self.feed.sampler.load_state_dict(pipe["sampler"])
        self.ledger.hand_back(pipe["untaken"])
        self.restored_point = {k: v for k, v in state.items() if k != "pipeline"}
        self.window.next_seq = int(pipe["seq"])  # the handed-back chunks keep their generation seeds under hold

    def metrics(self, batch: Batch, trained_version: int, step_s: float) -> dict[str, float]:
        """Staleness histogram of the step's samples, drops, and each pool's idle time (docs/async.md)."""
        stale = trained_version - batch["weights_version"]
        m = {"async/staleness_mean": float(stale.float().mean()), "async/staleness_max": float(stale.max()),
             "async/dropped_samples": float(self.dropped_samples), "async/open_groups": float(self.window.open_groups)}
        for j in range(self.p.max_staleness + 1):
            m[f"async/staleness_count/{j}"] = float((stale == j).sum())
        if self.p.segment_tokens is not None or self.p.stream:
            m.update(token_metrics(batch, trained_version, self.p.max_staleness))
        waited, busy = self.stream.take_times()
        m["async/actor_wait_s"] = waited
        m["async/rollout_busy_s"] = sum(busy)
        m["async/rollout_idle_s"] = self.rollout_idle_s
        self.dropped_samples, self.rollout_idle_s = 0, 0.0
        return m


class PipelineSampler:
    """The `sampler` Stateful of an async run's checkpoint: AsyncRollouts.checkpoint_state / restore."""

    def __init__(self, pipeline: AsyncRollouts) -> None:
        self.pipeline = pipeline

    def state_dict(self) -> dict:
        return self.pipeline.checkpoint_state()

    def load_state_dict(self, state: dict) -> None:
        self.pipeline.restore(state)


def oldest_token_version(batch: Batch) -> int:
    """The oldest weights version among the chunk's tokens (a sample's `weights_version` is its oldest token's, and
    an empty response's the version it was asked at): what the schedule bounds (Window.take)."""
    versions = batch["weights_version"]
    if "token_versions" in batch:
        mask = batch["response_mask"].bool()
        if mask.any():
            return min(int(versions.min()), int(batch["token_versions"][mask].min()))
    return int(versions.min())


def token_metrics(batch: Batch, trained_version: int, max_staleness: int) -> dict[str, float]:
    """Partial rollouts (docs/async.md): staleness per token of the step's responses (histogram J = 0..k, mean,
    max), the fraction of samples re-prefilled at least once (`continued_frac`) and of samples whose tokens come
    from more than one version (`mixed_version_frac`)."""
    mask = batch["response_mask"].bool()
    versions = batch["token_versions"]
    stale = (trained_version - versions)[mask]
    m = {"async/token_staleness_mean": float(stale.float().mean()) if stale.numel() else 0.0,
         "async/token_staleness_max": float(stale.max()) if stale.numel() else 0.0}
    for j in range(max_staleness + 1):
        m[f"async/token_staleness_count/{j}"] = float((stale == j).sum())
    big = torch.iinfo(versions.dtype).max
    newest = torch.where(mask, versions, torch.full_like(versions, -1)).max(1).values
    oldest = torch.where(mask, versions, torch.full_like(versions, big)).min(1).values
    mixed = (newest > oldest) & mask.any(1)
    m["async/mixed_version_frac"] = float(mixed.float().mean()) if len(batch) else 0.0
    if "segments" in batch:
        m["async/continued_frac"] = float((batch["segments"] > 1).float().mean()) if len(batch) else 0.0
    return m


def _concat(chunks: list[Batch]) -> Batch:
    """Chunks into one batch; their reward statistics combined (counts add; means and stds weigh by samples,
    which for a std is an approximation)."""
    batch = Batch.concat(chunks)
    stats: dict[str, float] = {}
    for part in chunks:
        for k, v in part.meta.get("reward_stats", {}).items():
            share = len(part) / len(batch) if "mean" in k or "std" in k else 1.0
            stats[k] = stats.get(k, 0.0) + v * share
    batch.meta["reward_stats"] = stats
    return batch
