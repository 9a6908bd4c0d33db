"""The controller: one RL step as named phases, and `fit()`, the loop that calls them.

PPO and the GRPO family differ only by registry entries (advantage estimator; whether a critic and a
reference exist, decided once in the Plan), never by a branch of this file. What crosses to a worker is a
typed message (workers/messages.py) built from Plan numbers.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch

from fleetrl.algo import (
    make_kl_controller,
)
from fleetrl.batch import Batch, GroupPartition
from fleetrl.cluster.group import WorkerGroup
from fleetrl.config.plan import Plan
from fleetrl.engines.sync_check import SyncCheckError, judge
from fleetrl.tracking.tracker import Tracker
from fleetrl.trainer.dynamic import fill_informative
from fleetrl.trainer.inputs import RunInputs
from fleetrl.trainer.local import LocalStepReports, RankLocalStep
from fleetrl.trainer.metrics import local_metrics, rollout_metrics
from fleetrl.trainer.progress import Progress, RNGState
from fleetrl.trainer.prompt_log import PromptLog
from fleetrl.trainer.signals import Interrupted, StopSignal
from fleetrl.trainer.validate import validate
from fleetrl.workers.episodes import generate_keys
from fleetrl.workers.layout import arrange_update
from fleetrl.workers.messages import GenerateRequest, UpdateMetrics
from fleetrl.workers.phases import (
    SEQ_KEYS,
    actor_keys,
    after_logprobs,
    critic_keys,
    loss_mask_key,
    seq_kl,
    shape_scores,
    update_spec,
    with_advantages,
)
from fleetrl.workers.worker import Worker

log = logging.getLogger("fleetrl.trainer")
# source=step's baseline: the largest gap over this many previous steps (Trainer.check_step_gap)
STEP_CHECK_WINDOW = 10


class Trainer:
    def __init__(self, plan: Plan, tracker: Tracker, out_dir: Path, resume: str | None = None,
                 stop: StopSignal | None = None, inputs: RunInputs | None = None) -> None:
        self.stop = stop or StopSignal()
        self.plan, self.cfg, self.tracker, self.out_dir = plan, plan.config, tracker, out_dir
        if self.cfg.cluster.backend != "local":
            # The controller's tensor work is small (per-group advantages, selects) and runs beside the workers'
            # processes: with one OpenMP thread per core each op's barrier waits for a thread another process
            # has preempted. One thread took a 4-GPU step from 1.84 to 1.19 s (4x H200, 2026-11-26). The local
            # backend's in-process worker sets the thread count itself (workers/context.py).
            torch.set_num_threads(1)
        self.resume = resume or self.cfg.trainer.resume
        inputs = inputs or RunInputs.load(plan)
        self.train_feed, self.val_feed, self.scorer = inputs.train, inputs.val, inputs.scorer
        kl = self.cfg.algorithm.kl
        self.kl_ctl = make_kl_controller(kl.controller, kl.coef, kl.target, kl.horizon)
        self.progress = Progress()
        self.rm = None
        if "reward_model" in plan.roles:
            from fleetrl.trainer.rm import ModelRewards

            self.rm = ModelRewards(self.cfg)
        self.groups: dict[str, WorkerGroup] = {}
        self.timings: dict[str, float] = {}
        # The step's group partitions, by (world size, mini-batches): made when the step's groups are generated
        # and reused by every later phase, so a sample is scored and trained where it was generated.
        self.partitions: dict[tuple[int, int], GroupPartition] = {}
        self.local: RankLocalStep | None = None  # Plan.rank_local: the step on each rank (trainer/local.py)
        self.pipeline = None  # trainer.mode=async: trainer/pipeline.py, built with the groups
        self.sync_gap: float | None = None  # the last policy check's gap (engines/sync_check.py)
        self.recent_gaps: deque[float] = deque(maxlen=STEP_CHECK_WINDOW)  # source=step: the baseline's window
        self.prompt_log = PromptLog(out_dir)  # prompts.jsonl: which prompts each step trained

    @property
    def step(self) -> int:
        return self.progress.step

    def state(self) -> dict:
        """What the controller checkpoints (each part saves itself: state_dict / load_state_dict)."""
        sampler = self.train_feed.sampler if self.pipeline is None else self.pipeline.sampler_state()
        return {"progress": self.progress, "sampler": sampler, "kl_ctl": self.kl_ctl,
                "rng": RNGState(), **(self.rm.state() if self.rm is not None else {})}

    # ------------------------------------------------------------------------------------------ loop
    def fit(self) -> dict[str, float]:
        self.build_groups()
        self.maybe_resume()
        self.check_sync(first=True)  # the baseline, or a resumed run against its own
        total = self.plan.total_steps
        last: dict[str, float] = {}
        if self.val_feed and self.cfg.trainer.val_before_train and self.step == 0:
            self.tracker.log(self.step, self.validate())
        self.tracker.start_progress(total, self.step)
        while self.step < total:
            for g in self.groups.values():
                g.step = self.step + 1  # stall reports name the step being made
            self.timings = {}
            self._call_stats()  # drop what validation/resume accumulated: only this step's calls count
            t0 = time.perf_counter()
            metrics, record = self.run_step()
            self.check_finite(metrics)
            self.sync()
            self.progress.step += 1
            metrics.update(self._step_metrics(record, time.perf_counter() - t0))
            self.check_step_gap(metrics)
            metrics["train/kl_coef"] = self.kl_ctl.coef
            if self.sync_gap is not None:
                metrics["train/sync_check/gap"] = self.sync_gap
            metrics.update(self._call_stats())
            self.checkpoint()
            if self.val_feed and self.cfg.trainer.val_every and (self.step % self.cfg.trainer.val_every == 0
                                                                  or self.step == total):
                metrics.update(self.validate())
            self.prompt_log.step(self.step, _trained_uids(record))
            self.tracker.log(self.step, metrics)
            last = metrics
            if self.stop.requested:
                self.stop_now()
        self.tracker.finish()
        return last

    # ---------------------------------------------------------------------------------------- phases
    def run_step(self) -> tuple[dict[str, float], Batch | LocalStepReports]:
        """One step's phases up to the update: on each rank for a colocated plan (trainer/local.py: the samples
        never leave their rank), else through the controller, phase by phase (the batch comes back each time)."""
        if self.local is not None:
            updates, reports = self.local.run(self.step, self.progress.weights_version, self.kl_ctl, self._timed)
            return _update_metrics(updates), reports
        batch = self.advantages(self.values(self.logprobs(self.rollouts())))
        return self.update(batch), batch

    def rollouts(self) -> Batch:
        """generate + score for one step's prompts; with dynamic sampling, more rounds until every group is
        informative (trainer/dynamic.py). Async: taken from the generation already running (trainer/pipeline.py)."""
        self.partitions = {}
        if self.pipeline is not None:
            with self._timed("rollout_wait"):
                return self.pipeline.next_batch(self.progress.weights_version)
        fresh = lambda: self.score(self.generate(self.train_feed.next_batch(self.cfg.data.prompts_per_step)))  # noqa: E731
        ds = self.cfg.algorithm.dynamic_sampling
        if not ds.enabled:
            return fresh()
        batch, stats = fill_informative(fresh(), fresh, groups=self.cfg.data.prompts_per_step, n=self.cfg.rollout.n,
                                        max_rounds=ds.max_rounds)
        self.partitions = {}  # groups from several rounds: the update partitions them afresh, by their tokens
        batch.meta["dynamic_sampling"] = stats
        return batch

    def generate(self, prompts: Batch) -> Batch:
        n = self.cfg.rollout.n
        with self._timed("generate"):
            batch = prompts.repeat_interleave(n)
            batch.tensors["group"] = torch.arange(len(prompts)).repeat_interleave(n)
            req = GenerateRequest(purpose="generate", step=self.step, temperature=self.cfg.rollout.temperature,
                                  min_weights_version=self.progress.weights_version)
            self.partitions = {}  # a new set of groups (dynamic sampling generates several per step)
            gen = batch.pick(*generate_keys(self.cfg.rollout), "group")
            out = self.group("rollout").call_groups(Worker.generate, gen, self.partition(batch, "rollout"), req)
            return batch.update(out)

    def score(self, batch: Batch) -> Batch:
        with self._timed("score"):
            # Decoded once when a reward model reads the texts too (256 x 256 tokens: ~30 ms on 2 cores).
            texts = self.scorer.decode(batch) if self.rm is not None else None
            scores, stats = self.scorer.score(batch, texts)
            if self.rm is not None:  # the reward_model role's scores, combined per data_source (trainer/rm.py)
                scores = self.rm.score(batch, scores, texts, self.group("reward_model"), stats)
            scores = shape_scores(batch, scores, stats, self.plan)
            batch.tensors["scores"] = scores
            batch.meta["reward_stats"] = stats
            return batch

    def logprobs(self, batch: Batch) -> Batch:
        with self._timed("logprobs"):
            seq = batch.pick(*SEQ_KEYS)
            if self.plan.recompute_logprobs:
                batch = batch.update(self.group("actor").call_groups(Worker.compute_logprobs, seq,
                                                                     self.partition(batch, "actor")))
            if self.plan.use_ref:
                batch = batch.update(self.group("ref").call_groups(Worker.compute_ref_logprobs, seq,
                                                                   self.partition(batch, "ref")))
            batch = after_logprobs(batch, self.plan)  # else (correction_in_loss) the actor loss corrects
            return batch

    def values(self, batch: Batch) -> Batch:
        if not self.plan.use_critic:
            return batch
        with self._timed("values"):
            return batch.update(self.group("critic").call_groups(Worker.compute_values, batch.pick(*SEQ_KEYS),
                                                                 self.partition(batch, "critic")))

    def advantages(self, batch: Batch) -> Batch:
        batch, kl = with_advantages(batch, self.plan, self.kl_ctl.coef)
        if kl is not None:
            batch.meta["kl"] = seq_kl(*kl)
            self.kl_ctl.update(batch.meta["kl"], len(batch))
        return batch

    def update(self, batch: Batch) -> dict[str, float]:
        reports: list[list[UpdateMetrics]] = []  # per role, per rank
        if self.plan.use_critic:
            with self._timed("update_critic"):
                reports.append(self._update_role("critic", batch.pick(*critic_keys(self.plan)), Worker.update_critic))
        if self.plan.actor_updates_at(self.step):
            with self._timed("update_actor"):
                reports.append(self._update_role("actor", batch.pick(*actor_keys(self.plan)), Worker.update_actor))
        return _update_metrics(reports)

    def _update_role(self, role: str, batch: Batch, method: Callable) -> list[UpdateMetrics]:
        parts, minis = arrange_update(batch, self.partition(batch, role),
                                      norm_len=float(self.cfg.rollout.max_response_tokens),
                                      mask_key=loss_mask_key(self.plan, role))
        return self.group(role).call_parts(method, parts, update_spec(self.plan, role, minis, self.kl_ctl.coef))

    def partition(self, batch: Batch, role: str) -> GroupPartition:
        """The step's group partition over `role`'s ranks: whole groups, mini-batch by mini-batch, balanced by
        tokens; made once per step and world size. Colocated roles share one world size and so one partition."""
        world, mini = self.plan.world[role], self.plan.num_mini_batches
        groups = len(batch) // self.cfg.rollout.n
        if groups % mini or (groups // mini) % world:  # a separate rollout pool of another size: its own split
            mini = 1
        key = (world, mini)
        if key not in self.partitions:
            self.partitions[key] = GroupPartition.of(batch, world, mini)
        return self.partitions[key]

    def sync(self) -> None:
        """Publishes the new actor weights to the rollout engines (in place when colocated)."""
        with self._timed("sync"):
            self.progress.weights_version += 1
            self._publish_weights()
        self.check_sync()

    def check_sync(self, *, first: bool = False) -> None:
        """The policy check (engines/sync_check.py): each rollout engine samples a few tokens, the trainer scores the
        same tokens on the ranks, and only the gaps come back. The run's first check sets its baseline."""
        if not self.plan.sync_check:
            return
        version = self.progress.weights_version
        with self._timed("sync_check"):
            if self.plan.rollout_colocated:
                gaps, where = self.group("rollout").call_all(Worker.check_sync, version), "colocated sync"
            else:
                from fleetrl.cluster.weight_sync import probe_gaps

                gaps = probe_gaps(self.group("actor"), self.group("rollout"), version, self.cfg.cluster.init_timeout_s,
                                  first=first)
                where = f"weight broadcast to pool '{self.plan.roles['rollout']}'"
        step = self.step if first else self.step + 1  # a sync comes before the step's count moves
        where += f" at {'resume' if self.step else 'start-up'}" if first else f" after step {step}"
        self.sync_gap = self._judge(gaps, self.progress.sync_baseline, version, where, step)
        if self.progress.sync_baseline is None:
            self.progress.sync_baseline = self.sync_gap

    def check_step_gap(self, metrics: dict[str, float]) -> None:
        """The policy check on the step's own samples (rollout.sync_check.source=step): they came from the weights
        of the previous sync, and the update scored them with the trainer's, so their mean log-prob gap checks that
        sync at no extra cost. Why the mean over the step's tokens: with a bf16 rollout the largest gap of single
        tokens is noise (0.25-2.2 a step in the SmolLM2 GPU job) while the mean stays within 0.01-0.05.
        The baseline is the largest gap of the previous STEP_CHECK_WINDOW steps (at first step 1's, start-up weights
        on both sides), so a sync that breaks shows as a jump while a slow honest drift does not stop the run: the
        CPU SmolLM2 LoRA job's gap grows 0.037 -> 0.087 over 12 steps, its bf16 merged decode copy rounding away
        LoRA increments below half a bf16 step of the base weight (train/sync_check/gap shows it)."""
        gap = metrics.get("train/rollout_logprob_diff_mean")
        if not self.plan.step_sync_check or gap is None:
            return
        t0 = time.perf_counter()
        version = self.progress.weights_version - 1  # the samples' weights: the step's update moved the version on
        where = f"{'colocated sync' if self.plan.rollout_colocated else 'weight sync'} to version {version}, " \
                f"checked on step {self.step}'s samples"
        baseline = max(self.recent_gaps) if self.recent_gaps else self.progress.sync_baseline
        self.sync_gap = self._judge([gap], baseline, version, where, self.step,
                                    measured=f"{gap:.4g} on average over the step's sampled tokens")
        self.recent_gaps.append(gap)
        self.progress.sync_baseline = max(self.recent_gaps)  # a resumed run starts from the window's baseline
        metrics["train/time/sync_check"] = time.perf_counter() - t0  # what bench/sync_check_cost.py reads

    def _judge(self, gaps: list[float], baseline: float | None, version: int, where: str, step: int,
               measured: str | None = None) -> float:
        """engines/sync_check.judge, with a failure also recorded as a `sync_check_failed` event at `step`."""
        try:
            return judge(gaps, baseline, self.cfg.rollout.sync_check, version=version, where=where, measured=measured)
        except SyncCheckError as e:
            self.tracker.event(step, "sync_check_failed", version=version, gap=e.gap, restart=e.restart)
            raise

    def _publish_weights(self) -> None:
        """Colocated: the engine already reads the actor's parameters, only the version moves. Separate pool:
        a bucketed broadcast that carries the version."""
        version = self.progress.weights_version
        if self.pipeline is not None:  # object store or the async bus (trainer.async_weights), installed by the engines
            self.pipeline.publish(version)
        elif self.plan.rollout_colocated:
            self.group("rollout").call_all(Worker.mark_weights_version, version)
        else:
            from fleetrl.cluster.weight_sync import broadcast_weights

            broadcast_weights(self.group("actor"), self.group("rollout"), version, self.cfg.cluster.init_timeout_s)

    def checkpoint(self, *, stopping: bool = False) -> None:
        """Saves this step when it is a multiple of trainer.save_every or, with trainer.save_last, the run's last
        (the steps after the last multiple are not lost, and `fleetrl export` has the final weights). `stopping`:
        stop_now's call, which comes right after the loop's own call for the same step, so it saves (with
        save_last) only a step that call did not: no step is saved twice."""
        t = self.cfg.trainer
        due = (bool(t.save_every) and self.step % t.save_every == 0) or (t.save_last and
                                                                      self.step == self.plan.total_steps)
        if (t.save_last and not due) if stopping else due:
            with self._timed("checkpoint"):
                from fleetrl.checkpoint.manager import save_checkpoint

                actor = self.group("actor") if t.delta_checkpoints != "off" else None
                path = save_checkpoint(self.out_dir, self.step, groups=list(self.groups.values()),
                                       state=self.state(), config=self.cfg, actor=actor)
                if t.export_every and self.step % t.export_every == 0:
                    from fleetrl.checkpoint.export import export_hf

                    export_hf(path, self.out_dir / "hf" / f"step_{self.step}", verify=False)

    def maybe_resume(self) -> None:
        from fleetrl.checkpoint.manager import find_resume, load_checkpoint
        from fleetrl.config import write_config

        path = find_resume(self.out_dir, self.resume)
        if path is None:
            # From step 0 over records already in metrics.jsonl (a recovery before the first checkpoint, or
            # resume=auto after a sweep's restart event): every step after 0 is written again and superseded.
            if _has_records(self.out_dir / "metrics.jsonl"):
                self.tracker.event(0, "resumed", path=None, supersedes_after=0)
                self.prompt_log.resumed(0)
            return
        diff = load_checkpoint(path, groups=list(self.groups.values()), state=self.state(), config=self.cfg)
        # Only now is this config accepted (the workers' load refuses another model's weights): run.py leaves the
        # run's config.yaml alone when resuming, so a refused resume does not overwrite it. A recovery's resume
        # writes it again, with the plan the run continues under (the fallback placement's, if it fell back).
        write_config(self.out_dir / "config.yaml", self.cfg)
        if diff:
            self.tracker.event(self.step, "config_changed_on_resume", diff=diff)
        # Records of steps after this one that metrics.jsonl already holds are superseded by the redone steps.
        self.tracker.event(self.step, "resumed", path=str(path), supersedes_after=self.step)
        self.prompt_log.resumed(self.step)
        self._publish_weights()  # the rollout engines must hold the resumed weights and version

    def stop_now(self) -> None:
        """After a stop signal (SIGINT or SIGTERM): checkpoint this step unless trainer.save_last is off, then stop,
        naming the newest checkpoint to continue from."""
        from fleetrl.checkpoint.manager import CheckpointError, find_resume

        self.checkpoint(stopping=True)
        try:
            latest = find_resume(self.out_dir, "auto")
        except CheckpointError:  # every checkpoint unusable: still stop, and say there is none
            latest = None
        self.tracker.event(self.step, "stopped", signal=int(self.stop.signum))
        raise Interrupted(self.step, int(self.stop.signum), int(latest.name[5:]) if latest else None)

    def check_finite(self, metrics: dict[str, float]) -> None:
        """A NaN/inf loss or gradient skips that optimiser step (the engine did) and is logged as an event."""
        skipped = {k: v for k, v in metrics.items() if k.endswith("skipped_updates") and v > 0}
        if not skipped:
            return
        self.tracker.event(self.step, "nonfinite_update_skipped", **skipped)
        if self.cfg.trainer.on_nonfinite == "abort":
            raise FloatingPointError(f"step {self.step}: non-finite loss or gradient ({skipped}); "
                                     f"set trainer.on_nonfinite=skip to skip such updates instead")

    def validate(self) -> dict[str, float]:
        with self._timed("validate"):
            if self.pipeline is not None:
                self.pipeline.load_engines()
            return validate(self.group("rollout"), self.val_feed, self.scorer, self.plan,
                            self.progress.weights_version)

    # --------------------------------------------------------------------------------------- helpers
    def build_groups(self) -> None:
        if self.groups:
            return
        from fleetrl.cluster.build import build_groups

        self.groups = build_groups(self.plan, self.out_dir)
        if self.plan.rank_local:
            self.local = RankLocalStep(self.plan, self.group("actor"), self.train_feed)
        if self.plan.pipeline is not None:
            from fleetrl.trainer.pipeline import AsyncRollouts

            self.pipeline = AsyncRollouts(self.plan, self.group("rollout"), self.group("actor"), self.train_feed,
                                          self.score)

    def _step_metrics(self, record: Batch | LocalStepReports, step_s: float) -> dict[str, float]:
        if isinstance(record, LocalStepReports):
            return local_metrics(record.rollouts, record.prepares, record.kl, self.timings, step_s,
                                 self.plan.recompute_logprobs)
        batch = record
        m = rollout_metrics(batch, self.timings, step_s, self.plan.recompute_logprobs, self.plan.action_mask)
        if self.pipeline is not None:
            # the version this step trained is the one before its sync
            m.update({f"train/{k}": v for k, v in
                      self.pipeline.metrics(batch, self.progress.weights_version - 1, step_s).items()})
        return m

    def _call_stats(self) -> dict[str, float]:
        """This step's worker-call telemetry (cluster/telemetry.py): Ray's overhead summed over pools, each
        pool's per-rank phase seconds (min/median/max, slowest rank) and the bytes through the driver."""
        out = {"train/time/worker_call_overhead": sum(g.take_overhead() for g in self.groups.values())}
        for g in self.groups.values():
            out.update({f"train/{k}": v for k, v in g.stats.take().items()})
        return out

    def group(self, role: str) -> WorkerGroup:
        return self.groups[self.plan.roles[role]]

    def shutdown(self) -> None:
        for g in self.groups.values():
            g.shutdown()
        self.groups = {}
        self.scorer.close()  # a restart builds a new Trainer: its reward workers must not pile up

    @contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - t


def _update_metrics(reports: list[list[UpdateMetrics]]) -> dict[str, float]:
    """The roles' update reports (per role, per rank) as train/* metrics."""
    return {f"train/{k}": v for k, v in UpdateMetrics.reduce_roles(reports).items()}


def _trained_uids(record: Batch | LocalStepReports) -> list[str]:
    """The uid of each group the step trained, in order (the first sample's of each group: a group shares one
    prompt); [] when the batch has no uids."""
    if isinstance(record, LocalStepReports):
        return list(record.prompts)
    if "uid" not in record:
        return []
    uids = record["uid"]
    return [str(uids[start]) for start, _ in record.group_spans()]


def _has_records(metrics: Path) -> bool:
    """Whether metrics.jsonl holds anything (the tracker writes it line-buffered, so its size is current)."""
    return metrics.is_file() and metrics.stat().st_size > 0
