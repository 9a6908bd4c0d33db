"""The config checks: the plain numeric ranges in one table (RANGES), then those that need more than one key or
a registry. Each raises ConfigError naming the keys, the value and the fix. `derive_plan` (plan.py) runs them
once, before it derives any number; split out to keep plan.py to the derivation itself.
"""
from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Callable, Mapping

from fleetrl.config.load import ConfigError
from fleetrl.config.schema import RunConfig

# Estimators that compare samples of the same prompt need at least two of them.
GROUP_ESTIMATORS = ("grpo", "grpo_turns", "drgrpo", "rloo", "reinforce_plus_plus_baseline")
# trainer.resume's keywords (checkpoint/manager.py:find_resume reads any other value as a path).
RESUME_KEYWORDS = ("auto", "never")

# The accepted ranges, by name; NaN fails every one (its comparisons are all False).
_RULES: dict[str, Callable[[float], bool]] = {
    ">= 0": lambda v: v >= 0,
    ">= 1": lambda v: v >= 1,
    "> 0": lambda v: v > 0,
    "in [0, 1]": lambda v: 0 <= v <= 1,
    "in (0, 1]": lambda v: 0 < v <= 1,
    "in [0, 1)": lambda v: 0 <= v < 1,
}
_OFF, _GREEDY, _SECONDS = " (0 = off)", " (0 = greedy)", " seconds"
# Every numeric key with a plain range: (dotted key, rule, note). A None value (null = off / default) and a
# non-number (`call_timeout_s: auto`) pass; list values are checked element by element, mapping values by key.
# Ranges that depend on other keys, or keep a message of their own, live in the check_* functions below.
RANGES: tuple[tuple[str, str, str], ...] = (
    ("data.max_prompt_length", ">= 1", ""),
    ("data.prompts_per_step", ">= 1", ""),
    ("data.val_max_prompts", ">= 1", " (null = every validation prompt)"),
    ("rollout.n", ">= 1", ""),
    ("rollout.val_n", ">= 1", ""),
    ("rollout.temperature", ">= 0", _GREEDY),
    ("rollout.val_temperature", ">= 0", _GREEDY),
    ("rollout.top_p", "in (0, 1]", " (1 = off)"),
    ("rollout.top_k", ">= 0", _OFF),
    ("rollout.max_new_tokens", ">= 1", ""),
    ("rollout.tensor_parallel", ">= 1", " (1 = no tensor parallelism)"),
    ("rollout.gpu_memory_fraction", "in (0, 1]", " (null = a slot for every sample)"),
    ("rollout.stop_token_ids", ">= 0", " (token ids)"),
    ("rollout.vllm.gpu_memory_utilization", "in (0, 1]", ""),
    ("rollout.vllm.sync_check_tokens", ">= 0", _OFF),
    ("rollout.vllm.sync_check_tol", ">= 0", ""),
    ("rollout.sync_check.tokens", ">= 0", _OFF),
    ("rollout.sync_check.sequences", ">= 1", ""),
    ("rollout.sync_check.threshold", ">= 0", " (a log-prob gap; .inf = never)"),
    ("rollout.env.max_turns", ">= 1", ""),
    ("rollout.env.max_total_tokens", ">= 1", ""),
    ("rollout.env.max_tokens_per_turn", ">= 1", ""),
    ("rollout.env.timeout_s", "> 0", _SECONDS),
    ("algorithm.gamma", "in [0, 1]", ""),
    ("algorithm.lam", "in [0, 1]", ""),
    ("algorithm.clip_low", "in [0, 1]", " (the ratio is clipped below at 1 - clip_low; typical 0.2, 1 = no lower "
                                         "bound, as CISPO uses it)"),
    ("algorithm.clip_high", ">= 0", " (typical 0.2; DAPO clip-higher 0.28)"),
    ("algorithm.value_clip", "> 0", " (null = no value clipping)"),
    ("algorithm.kl.coef", ">= 0", ""),
    ("algorithm.kl.target", "> 0", ""),
    ("algorithm.kl.horizon", ">= 1", ""),
    ("algorithm.ppo_epochs", ">= 1", ""),
    ("algorithm.mini_batch_prompts", ">= 1", " (null = all prompts of the step)"),
    ("algorithm.micro_batch_size", ">= 1", " (samples per rank per forward/backward)"),
    ("algorithm.overlong.factor", ">= 0", ""),
    ("algorithm.dynamic_sampling.max_rounds", ">= 1", ""),
    ("actor.logprob_chunk", ">= 1", " (null = whole sequence at once)"),
    *((f"{role}.optim.{key}", rule, note) for role in ("actor", "critic") for key, rule, note in (
        ("warmup_steps", ">= 0", ""), ("min_lr_ratio", "in [0, 1]", ""), ("grad_clip", ">= 0", _OFF),
        ("weight_decay", ">= 0", ""), ("betas", "in [0, 1)", ""), ("eps", "> 0", ""))),
    ("critic.warmup_steps", ">= 0", ""),
    ("rewards.timeout_s", "> 0", _SECONDS),
    ("rewards.num_workers", ">= 1", ""),
    ("rewards.remote_timeout_s", "> 0", _SECONDS),
    ("rewards.max_failure_rate", "in [0, 1]", " (1 = never stop)"),
    ("rewards.remote_connect_timeout_s", "> 0", _SECONDS),
    ("rewards.remote_retries", ">= 0", ""),
    ("rewards.remote_backoff_s", ">= 0", _SECONDS),
    ("trainer.total_steps", ">= 1", ""),
    ("trainer.total_epochs", ">= 1", ""),
    *((f"trainer.{key}", ">= 0", _OFF) for key in ("val_every", "save_every", "keep_last", "keep_every",
                                                    "export_every", "max_restarts")),
    ("trainer.restart_wait_s", ">= 0", _SECONDS),
    ("cluster.num_cpus", ">= 1", " (null = the machine's)"),
    ("cluster.placement_timeout_s", "> 0", _SECONDS),
    ("cluster.init_timeout_s", "> 0", _SECONDS),
    ("cluster.call_timeout_s", "> 0", " seconds, or auto"),
    ("cluster.first_call_timeout_s", "> 0", _SECONDS),
    ("cluster.call_timeouts", "> 0", _SECONDS),
    ("cluster.stall_s", "> 0", _SECONDS),
    ("cluster.first_call_stall_s", "> 0", _SECONDS),
)


def check_ranges(cfg: RunConfig) -> None:
    """Every RANGES row, before anything derives from the numbers (a negative top_k would otherwise pass here
    and fail inside the first generate call, after the run directory exists)."""
    for key, rule, note in RANGES:
        for where, value in _numbers(key, _lookup(cfg, key)):
            if not _RULES[rule](value):
                raise ConfigError(f"{where} must be {rule}{note}, got {value}")


def _lookup(cfg: RunConfig, key: str) -> Any:
    """The value at a dotted key; None when a section on the way is unset (rollout.env: null)."""
    node: Any = cfg
    for part in key.split("."):
        if node is None:
            return None
        node = getattr(node, part)
    return node


def _numbers(key: str, value: Any) -> list[tuple[str, float]]:
    """(key, number) pairs to check: one for a number, one per element of a list or entry of a mapping."""
    if isinstance(value, Mapping):
        return [p for k, v in value.items() for p in _numbers(f"{key}.{k}", v)]
    if isinstance(value, (list, tuple)):
        return [p for i, v in enumerate(value) for p in _numbers(f"{key}[{i}]", v)]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [(key, value)]
    return []


def check_resume(cfg: RunConfig) -> None:
    """trainer.resume is `auto`, `never` or the path of a checkpoint: a typo of a keyword would otherwise be
    read as a path and fail later as a missing checkpoint, with no word about the keywords."""
    value = cfg.trainer.resume
    # As find_resume reads it (no ~ expansion); "" would be Path("."), which exists.
    if value in RESUME_KEYWORDS or (value.strip() and Path(value).exists()):
        return
    guess = difflib.get_close_matches(value.strip().lower(), RESUME_KEYWORDS, n=1)
    if value.strip() and not guess:
        # A path that is not here may be there: the plan is also derived where the run is prepared (a sweep, a
        # slurm script) rather than where it resumes. find_resume names a missing checkpoint where the run starts.
        return
    hint = f"; did you mean {guess[0]!r}?" if guess else ""
    raise ConfigError(f"trainer.resume={value!r} is neither auto, never nor an existing path{hint} (accepted: "
                      f"auto = the newest complete checkpoint in trainer.output_dir, never = start fresh, or the "
                      f"path of a checkpoint directory such as OUT/checkpoints/step_N)")


def check_names(cfg: RunConfig) -> None:
    """Registry-backed names (the registry is their one list); Literal choices were checked by the loader."""
    from fleetrl.algo import ADVANTAGES, AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES
    from fleetrl.algo.correction import check_correction
    from fleetrl.config.reward_model import check_reward_model

    a = cfg.algorithm
    one_of("algorithm.advantage", a.advantage, ADVANTAGES.names())
    one_of("algorithm.policy_loss", a.policy_loss, POLICY_LOSSES.names())
    one_of("algorithm.loss_agg", a.loss_agg, AGGREGATIONS.names())
    one_of("algorithm.kl.estimator", a.kl.estimator, KL_ESTIMATORS.names())
    check_reward_model(cfg.rewards)
    if "reward_model" in cfg.cluster.roles and cfg.rewards.model is None:
        raise ConfigError("cluster.roles.reward_model is set but rewards.model is not; set rewards.model.path "
                          "or remove the role")
    if a.dual_clip is not None and a.dual_clip <= 1.0:
        raise ConfigError(f"algorithm.dual_clip must be > 1 (Ye et al. 2020 use 3), got {a.dual_clip}")
    if a.dual_clip is not None and a.policy_loss not in ("ppo", "gspo"):
        raise ConfigError(f"algorithm.dual_clip has no effect with policy_loss={a.policy_loss}; unset it or use ppo")
    c = a.rollout_correction
    try:
        check_correction(c.mode, c.level, c.cap, c.low, c.high)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not 0 <= a.overlong.buffer <= cfg.rollout.max_new_tokens:
        raise ConfigError(f"algorithm.overlong.buffer={a.overlong.buffer} must be between 0 (off) and "
                          f"rollout.max_new_tokens={cfg.rollout.max_new_tokens}")
    t = cfg.trainer
    if (t.total_steps is None) == (t.total_epochs is None):
        raise ConfigError("set exactly one of trainer.total_steps and trainer.total_epochs "
                          f"(got total_steps={t.total_steps}, total_epochs={t.total_epochs}); "
                          "total_steps: null selects epoch mode")
    for role, optim in (("actor", cfg.actor.optim), ("critic", cfg.critic.optim)):
        if not optim.lr > 0:
            raise ConfigError(f"{role}.optim.lr must be > 0, got {optim.lr} (RL fine-tuning typically uses 1e-6 to "
                              f"1e-5; freeze a model by leaving its role out instead)")


def check_sampling(cfg: RunConfig) -> None:
    r = cfg.rollout
    if cfg.algorithm.advantage in GROUP_ESTIMATORS and r.n < 2:
        raise ConfigError(f"algorithm.advantage={cfg.algorithm.advantage} compares samples of the same prompt, "
                          f"so rollout.n must be >= 2 (got {r.n}); raise rollout.n or use gae/reinforce_plus_plus")


def check_env(cfg: RunConfig) -> None:
    """rollout.env against the other keys (its numbers are in RANGES). Whether its name, file and kwargs build an
    environment is the environments' to say: envs/check.py, called where the run is assembled."""
    if cfg.rollout.env is not None and cfg.algorithm.overlong.buffer:
        raise ConfigError("algorithm.overlong.buffer penalises one generation's length; with rollout.env an "
                          "episode's length is bounded by rollout.env.max_total_tokens instead: set "
                          "algorithm.overlong.buffer=0 (mask_truncated still works: it drops episodes that ran "
                          "out of that budget)")


def check_lora(cfg: RunConfig) -> None:
    """The adapter's numbers; whether `targets` name modules of the model is checked when it loads
    (fleetrl/models/lora.py), where the module names are known."""
    lora = cfg.actor.lora
    if lora is None:
        return
    if lora.rank < 1 or lora.alpha <= 0 or not 0 <= lora.dropout < 1:
        raise ConfigError(f"actor.lora needs rank >= 1, alpha > 0 and 0 <= dropout < 1; got rank={lora.rank}, "
                          f"alpha={lora.alpha}, dropout={lora.dropout} (typical: rank 8-64, alpha = 2 x rank)")
    if not lora.targets or any(not t.strip() for t in lora.targets):
        raise ConfigError(f"actor.lora.targets must list module names such as [q_proj, v_proj] or [all-linear]; "
                          f"got {list(lora.targets)}")


def check_share_prompts(cfg: RunConfig) -> None:
    """Two forwards run a prompt once for the samples that share it: HF's padded, chunked one (the prompt's KV
    cache gathered per row) and the native packed one (one prompt copy per packed run, models/packing.py)."""
    a, budget = cfg.actor, cfg.algorithm.micro_batch_tokens
    if not a.share_prompts:
        return
    if a.forward == "native":
        if budget is None:
            raise ConfigError("actor.share_prompts with actor.forward=native needs packed micro-batches: set "
                              "algorithm.micro_batch_tokens (e.g. 16384), or share_prompts=false")
        return
    if a.logprob_chunk is None or budget is not None:
        raise ConfigError(f"actor.share_prompts with actor.forward=hf works on the padded, chunked forward only; got "
                          f"actor.logprob_chunk={a.logprob_chunk}, algorithm.micro_batch_tokens={budget}. Set "
                          "actor.logprob_chunk (e.g. 16) and micro_batch_tokens=null; or actor.forward=native with "
                          "micro_batch_tokens; or share_prompts=false")


def one_of(key: str, value: str, choices: list[str]) -> None:
    if value not in choices:
        raise ConfigError(did_you_mean(key, value, choices, "value"))


def did_you_mean(key: str, value: str, choices, what: str) -> str:
    guess = difflib.get_close_matches(str(value), list(choices), n=1)
    hint = f"; did you mean {guess[0]!r}?" if guess else ""
    return f"{key}: unknown {what} {value!r}{hint} (choose from: {', '.join(map(str, choices))})"


def divisors(k: int) -> str:
    """"1, 2, 4, ..." of k: what a refusal offers where a number must divide k."""
    return ", ".join(str(d) for d in range(1, k + 1) if k % d == 0)
