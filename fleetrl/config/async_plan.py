"""The asynchronous pipeline's part of the Plan (trainer.mode=async): checked and derived here, once, so the
controller (trainer/pipeline.py) only reads numbers. Called by `config/plan.py:derive_plan`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping

from fleetrl.config.load import ConfigError
from fleetrl.config.schema import RunConfig

_SPLIT_EXAMPLE = ("cluster.pools={train: {workers_per_node: 1, gpus_per_worker: 1}, gen: {workers_per_node: 1, "
                  "gpus_per_worker: 1}} cluster.roles={actor: train, rollout: gen}")


@dataclass(frozen=True, kw_only=True)
class AsyncPlan:
    """How far generation runs ahead of training, and in what pieces."""
    max_staleness: int
    """k: step s trains the policy of version s-1 on samples of version >= s-1-k."""
    stale: Literal["hold", "drop"]
    groups_per_step: int
    """P = data.prompts_per_step: whole GRPO groups one step trains on."""
    chunk_groups: int
    """G: groups per generate call (one call runs on one rollout worker); divides P."""
    window_groups: int
    """(k+1)·P: groups submitted but not yet consumed (trained on or dropped) at most. Generation submitted at
    version v is then among the first consumed by step v+k+1, which bounds staleness by k (trainer/schedule.py)."""
    max_chunks_per_step: int
    """Chunks one step may consume: P/G, times algorithm.dynamic_sampling.max_rounds when it is on."""
    segment_tokens: int | None = None
    """trainer.partial_rollouts: new tokens per sample per segment of a generate call (workers/partial.py); the
    rollout worker installs the newest published weights between segments. None = partial rollouts off."""
    stream_calls: int = 0
    """trainer.stream_rollouts: generate calls one rollout worker may hold at once (the window's chunks, all of
    which one worker may hold under stale=drop, plus two for a weights load and a validation call), all served by
    its one engine loop (engines/fast/stream.py); its serial concurrency group is that wide. 0 = streaming off:
    calls run one after another."""

    weights: Literal["store", "bus"] = "store"
    """trainer.async_weights, resolved: bus = each version broadcast from actor rank 0 to the rollout workers
    (cluster/weight_sync.py `broadcast_weights`, beside_decode), store = through Ray's object store (trainer/pipeline.py publish)."""

    @property
    def stream(self) -> bool:
        return self.stream_calls > 0

    @property
    def chunks_per_step(self) -> int:
        return self.groups_per_step // self.chunk_groups


def derive_async(cfg: RunConfig, roles: Mapping[str, str], rollout_world: int, *,
                 same_device: bool = True) -> AsyncPlan | None:
    """None in synchronous mode; ConfigError naming the key and the fix when async cannot run this config."""
    t = cfg.trainer
    if t.mode == "sync":
        if t.stream_rollouts:
            raise ConfigError("trainer.stream_rollouts=true serves an async rollout pool's generate calls from one "
                              "engine loop, taking up weights published while they run, which only trainer.mode=async "
                              "publishes; set trainer.mode=async or trainer.stream_rollouts=false")
        if t.partial_rollouts:
            raise ConfigError("trainer.partial_rollouts=true continues unfinished samples on weights published while "
                              "they generate, which only trainer.mode=async publishes; set trainer.mode=async or "
                              "trainer.partial_rollouts=false")
        return None
    if roles["rollout"] == roles["actor"]:
        raise ConfigError(f"trainer.mode=async overlaps generation with training, so the rollout role needs its own "
                          f"pool; cluster.roles puts rollout and actor both in pool '{roles['actor']}'. Give the "
                          f"rollout a pool of its own, e.g. {_SPLIT_EXAMPLE}, or set trainer.mode=sync")
    if cfg.cluster.backend != "ray":
        raise ConfigError("trainer.mode=async runs the rollout pool as Ray workers beside the trainer; "
                          "cluster.backend=local holds every worker in the driver process. Set cluster.backend=ray "
                          "or trainer.mode=sync")
    if t.max_staleness < 0:
        raise ConfigError(f"trainer.max_staleness must be >= 0 weight versions (0 = the synchronous schedule, "
                          f"1 = one step of overlap), got {t.max_staleness}")
    prompts = cfg.data.prompts_per_step
    chunk = t.chunk_groups if t.chunk_groups is not None else _default_chunk(prompts, rollout_world)
    if chunk < 1 or prompts % chunk:
        divisors = ", ".join(str(d) for d in range(1, prompts + 1) if prompts % d == 0)
        raise ConfigError(f"trainer.chunk_groups={chunk} must divide data.prompts_per_step={prompts} so every "
                          f"step is whole generate calls of whole groups; choose one of {divisors}")
    ds = cfg.algorithm.dynamic_sampling
    per_step = prompts // chunk
    return AsyncPlan(max_staleness=t.max_staleness, stale=t.stale, groups_per_step=prompts, chunk_groups=chunk,
                     window_groups=(t.max_staleness + 1) * prompts,
                     max_chunks_per_step=per_step * (ds.max_rounds if ds.enabled else 1),
                     segment_tokens=_segment_tokens(cfg), stream_calls=(calls := _stream_calls(cfg, chunk)),
                     weights=_weight_path(cfg, streamed=calls > 0, same_device=same_device))


def _weight_path(cfg: RunConfig, *, streamed: bool, same_device: bool) -> Literal["store", "bus"]:
    """trainer.async_weights resolved. The bus needs the engine loop: only it installs whatever version arrived last,
    from a staging copy, between decode rounds; a plain or segmented call installs the exact version it is tagged
    with. Its two ends must share a backend (NCCL between GPUs, Gloo between CPUs). (Every async rollout worker holds
    whole weights: the async mode refuses rollout.tensor_parallel > 1.)"""
    t = cfg.trainer
    if t.async_weights == "auto":
        return "bus" if streamed and same_device else "store"
    if t.async_weights == "bus" and not streamed:
        raise ConfigError("trainer.async_weights=bus cannot run with trainer.stream_rollouts=false: only the streamed "
                          "engine loop installs a version received beside its decoding; set "
                          "trainer.stream_rollouts=true, or trainer.async_weights=store (or auto)")
    if t.async_weights == "bus" and not same_device:
        raise ConfigError("trainer.async_weights=bus broadcasts between the actor and rollout pools over one backend "
                          "(NCCL between GPUs, Gloo between CPUs), and one of the two pools has GPUs while the other "
                          "has none; set trainer.async_weights=store (or auto), or give both pools the same device")
    return t.async_weights


def _segment_tokens(cfg: RunConfig) -> int | None:
    """trainer.partial_rollouts: the per-segment new-token budget, or None when off (ConfigError where the rollout
    cannot continue a prefix)."""
    t, r = cfg.trainer, cfg.rollout
    if not t.partial_rollouts:
        return None
    if r.engine not in ("hf", "fast"):
        raise ConfigError(f"trainer.partial_rollouts=true re-prefills unfinished samples (prompt plus tokens so far) "
                          f"with per-sample limits, which the hf and fast engines do and rollout.engine={r.engine} "
                          f"does not; set rollout.engine=fast (or hf) or trainer.partial_rollouts=false")
    if r.env is not None:
        raise ConfigError("trainer.partial_rollouts=true segments single-turn generations; rollout.env runs multi-turn "
                          "episodes, whose turns are not continued across weight versions. Set "
                          "trainer.partial_rollouts=false or remove rollout.env")
    seg = t.partial_segment_tokens if t.partial_segment_tokens is not None else -(-r.max_new_tokens // 4)
    if not 1 <= seg <= r.max_new_tokens:
        raise ConfigError(f"trainer.partial_segment_tokens={seg} must be in 1..rollout.max_new_tokens="
                          f"{r.max_new_tokens} (new tokens per sample per segment); set it there or null "
                          f"(ceil(max_new_tokens / 4))")
    return seg


def _stream_calls(cfg: RunConfig, chunk: int) -> int:
    """trainer.stream_rollouts: the calls one rollout worker may hold (0 = off); ConfigError where it cannot run."""
    t, r = cfg.trainer, cfg.rollout
    if not t.stream_rollouts:
        return 0
    if r.engine != "fast":
        raise ConfigError(f"trainer.stream_rollouts=true runs the fast engine's continuous-batching loop across calls; "
                          f"rollout.engine={r.engine} has none here: set rollout.engine=fast or "
                          "trainer.stream_rollouts=false")
    if t.partial_rollouts:
        raise ConfigError("trainer.stream_rollouts=true takes up new weights between decode rounds, which supersedes "
                          "trainer.partial_rollouts' segments: set one of them to false")
    if r.env is not None:
        raise ConfigError("trainer.stream_rollouts=true streams single-turn generations; rollout.env runs multi-turn "
                          "episodes. Set trainer.stream_rollouts=false or remove rollout.env")
    # All of the window's chunks may sit on one worker: chunks go round-robin, but under stale=drop a slow worker
    # keeps its chunks while the others' are taken and replaced (threads waiting in the loop cost nothing).
    return (t.max_staleness + 1) * (cfg.data.prompts_per_step // chunk) + 2


def _default_chunk(prompts: int, world: int) -> int:
    """The largest divisor of P that is at most ceil(P / world): one call per rollout worker per step when P
    splits evenly (with one rollout worker, the whole step in one call, exactly as synchronous mode)."""
    target = -(-prompts // world)
    return max(d for d in range(1, target + 1) if prompts % d == 0)
