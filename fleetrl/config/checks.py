"""The config checks that need more than one key or a registry: each raises ConfigError naming the keys, the value
and the fix. `derive_plan` (plan.py) runs them once, before it derives any number; split out to keep plan.py to
the derivation itself.
"""
from __future__ import annotations

import difflib

from fleetrl.config.load import ConfigError
from fleetrl.config.schema import RunConfig

# Estimators that compare samples of the same prompt need at least two of them.
GROUP_ESTIMATORS = ("grpo", "grpo_turns", "drgrpo", "rloo", "reinforce_plus_plus_baseline")


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
    if a.dynamic_sampling.max_rounds < 1:
        raise ConfigError(f"algorithm.dynamic_sampling.max_rounds must be >= 1, got {a.dynamic_sampling.max_rounds}")
    t = cfg.trainer
    if (t.total_steps is None) == (t.total_epochs is None):
        raise ConfigError("set exactly one of trainer.total_steps and trainer.total_epochs "
                          f"(got total_steps={t.total_steps}, total_epochs={t.total_epochs}); "
                          "total_steps: null selects epoch mode")
    for key, value in (("trainer.total_steps", t.total_steps), ("trainer.total_epochs", t.total_epochs),
                       ("data.prompts_per_step", cfg.data.prompts_per_step)):
        if value is not None and value < 1:
            raise ConfigError(f"{key} must be >= 1, got {value}")
    for key, value in (("trainer.save_every", t.save_every), ("trainer.val_every", t.val_every),
                       ("trainer.keep_last", t.keep_last), ("trainer.keep_every", t.keep_every),
                       ("trainer.export_every", t.export_every), ("trainer.max_restarts", t.max_restarts)):
        if value < 0:
            raise ConfigError(f"{key} must be >= 0 (0 = off), got {value}")
    for role, optim in (("actor", cfg.actor.optim), ("critic", cfg.critic.optim)):
        if not optim.lr > 0:
            raise ConfigError(f"{role}.optim.lr must be > 0, got {optim.lr} (RL fine-tuning typically uses 1e-6 to "
                              f"1e-5; freeze a model by leaving its role out instead)")


def check_sampling(cfg: RunConfig) -> None:
    r = cfg.rollout
    if r.n < 1 or r.val_n < 1:
        raise ConfigError(f"rollout.n and rollout.val_n must be >= 1 (got {r.n}, {r.val_n})")
    if cfg.algorithm.advantage in GROUP_ESTIMATORS and r.n < 2:
        raise ConfigError(f"algorithm.advantage={cfg.algorithm.advantage} compares samples of the same prompt, "
                          f"so rollout.n must be >= 2 (got {r.n}); raise rollout.n or use gae/reinforce_plus_plus")
    if r.temperature < 0 or r.val_temperature < 0:
        raise ConfigError("rollout.temperature and rollout.val_temperature must be >= 0 (0 = greedy)")
    if not 0 < r.top_p <= 1:
        raise ConfigError(f"rollout.top_p must be in (0, 1], got {r.top_p}")
    if r.max_new_tokens < 1:
        raise ConfigError(f"rollout.max_new_tokens must be >= 1, got {r.max_new_tokens}")


def check_env(cfg: RunConfig) -> None:
    """rollout.env: the numbers, then one instance built (env_factory does), so a bad name, file or keyword
    fails here, before any worker starts."""
    env = cfg.rollout.env
    if env is None:
        return
    for key, value in (("max_turns", env.max_turns), ("max_total_tokens", env.max_total_tokens),
                       ("max_tokens_per_turn", 1 if env.max_tokens_per_turn is None else env.max_tokens_per_turn)):
        if value < 1:
            raise ConfigError(f"rollout.env.{key} must be >= 1, got {value}")
    if not env.timeout_s > 0:
        raise ConfigError(f"rollout.env.timeout_s must be > 0 seconds, got {env.timeout_s}")
    if cfg.algorithm.overlong.buffer:
        raise ConfigError("algorithm.overlong.buffer penalises one generation's length; with rollout.env an "
                          "episode's length is bounded by rollout.env.max_total_tokens instead: set "
                          "algorithm.overlong.buffer=0 (mask_truncated still works: it drops episodes that ran "
                          "out of that budget)")
    from fleetrl.envs.base import EnvError, env_factory

    try:
        env_factory(env.name, **env.kwargs)
    except EnvError as e:
        raise ConfigError(f"rollout.env.name / rollout.env.kwargs: {e}") from None


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
