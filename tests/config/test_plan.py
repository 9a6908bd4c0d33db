"""Plan fields with hand-computed numbers: seeds, rollout engine sizes, colocation, on-policy decision,
optimiser steps, CPU threads, summary keys."""
from __future__ import annotations

import pytest

from fleetrl.config import derive_plan, load_config
from fleetrl.config.plan import EngineSizes, Plan

SEPARATE_ROLLOUT = ("cluster.pools.main.cpus_per_worker=0.25", "cluster.pools.gen.cpus_per_worker=2",
                    "cluster.roles.rollout=gen")


def _plan(*overrides: str) -> Plan:
    return derive_plan(load_config(None, ["algorithm.micro_batch_size=1", *overrides]))


def test_seed_formulas_are_fixed():
    # These exact numbers feed the golden losses (tests/assets/losses): they must never change silently.
    p = _plan("trainer.seed=3")
    assert p.seed("worker", rank=2) == 3 * 1000 + 2 == 3002
    assert p.seed("engine", rank=2) == 3 + 2
    # (3 · 100003 + 4) · 1009 + 1 = 300013 · 1009 + 1 = 302713117 + 1
    assert p.seed("generate", step=4, rank=1) == 302_713_118
    assert p.seed("validate", step=4, rank=1) == (3 + 7) * 1009 + 1 == 10091  # step does not enter
    assert p.seed("sampler", step=9, rank=5) == 3
    with pytest.raises(ValueError, match="unknown seed purpose 'shuffle'"):
        p.seed("shuffle")  # type: ignore[arg-type]


def test_rollout_engine_sizes():
    # 8 prompts × 4 = 32 samples over 2 rollout workers = 16 each; validation: max(2 workers, 8 prompts,
    # 32 samples // val_n 5 = 6) = 8 prompts × val_n 5 = 40 samples -> 20 per worker, which is the larger.
    p = _plan("data.prompts_per_step=8", "rollout.n=4", "rollout.val_n=5", "cluster.pools.main.workers_per_node=2",
              "data.max_prompt_length=32", "rollout.max_new_tokens=4")
    assert p.rollout == EngineSizes(max_batch=20, max_seq_len=32 + 4)
    assert p.val_batch_prompts == 8
    # val_n 1: a validation call takes max(2, 8, 32 // 1) = 32 prompts, 16 per worker = the training samples per worker.
    p = _plan("data.prompts_per_step=8", "rollout.n=4", "cluster.pools.main.workers_per_node=2")
    assert p.rollout.max_batch == 16 and p.val_batch_prompts == 32
    # 6 prompts × val_n 5 = 30 validation samples over 2 workers = 15 each > 6 × 4 / 2 = 12 training samples.
    p = _plan("data.prompts_per_step=6", "rollout.n=4", "rollout.val_n=5", "cluster.pools.main.workers_per_node=2")
    assert p.rollout.max_batch == 15


def test_rollout_colocated_only_when_it_shares_the_actor_pool():
    assert _plan().rollout_colocated
    p = _plan(*SEPARATE_ROLLOUT)
    assert not p.rollout_colocated and dict(p.roles) == {"actor": "main", "rollout": "gen"}


def test_recompute_logprobs_only_when_the_update_is_not_on_policy():
    assert not _plan("data.prompts_per_step=8").recompute_logprobs  # 1 mini-batch, 1 epoch
    assert _plan("data.prompts_per_step=8", "algorithm.mini_batch_prompts=4").recompute_logprobs  # 2 mini-batches
    assert _plan("data.prompts_per_step=8", "algorithm.ppo_epochs=2").recompute_logprobs
    assert _plan("data.prompts_per_step=8", "algorithm.recompute_logprobs=always").recompute_logprobs
    # Rollout correction on-policy: the actor loss weighs its own detached log-probs against the rollout's.
    p = _plan("data.prompts_per_step=8", "algorithm.rollout_correction.mode=tis")
    assert p.rollout_correction and not p.recompute_logprobs and p.correction_in_loss
    p = _plan("data.prompts_per_step=8", "algorithm.rollout_correction.mode=tis", "algorithm.ppo_epochs=2")
    assert p.recompute_logprobs and not p.correction_in_loss  # the controller weighs the recomputed ones


def test_kl_folds_into_the_score_only_for_outcome_estimators_with_kl_in_the_reward():
    assert _plan("algorithm.advantage=grpo", "algorithm.kl.placement=reward").kl_into_score
    assert not _plan("algorithm.advantage=gae", "algorithm.kl.placement=reward").kl_into_score  # token rewards
    assert not _plan("algorithm.advantage=grpo", "algorithm.kl.placement=loss").kl_into_score


def test_optimizer_steps_leave_out_the_critic_warmup():
    # 10 steps, 2 mini-batches, 3 epochs; the actor waits 4 warm-up steps: (10 - 4) · 2 · 3 = 36; critic 10 · 2 · 3.
    common = ("trainer.total_steps=10", "data.prompts_per_step=8", "algorithm.mini_batch_prompts=4",
              "algorithm.ppo_epochs=3", "critic.warmup_steps=4")
    p = _plan(*common, "algorithm.advantage=gae")
    assert (p.actor_optimizer_steps, p.critic_optimizer_steps) == (36, 60)
    assert [p.actor_updates_at(s) for s in (0, 3, 4, 9)] == [False, False, True, True]
    # Without a critic the warm-up does not apply: 10 · 2 · 3 = 60, and the actor updates from step 0.
    p = _plan(*common, "algorithm.advantage=grpo")
    assert p.actor_optimizer_steps == 60 and p.actor_updates_at(0)


def test_cpu_threads_are_the_whole_cpu_share():
    p = _plan(*SEPARATE_ROLLOUT)
    assert (p.pools["main"].cpu_threads, p.pools["gen"].cpu_threads) == (1, 2)  # 0.25 -> 1 (at least one), 2 -> 2


def test_summary_lists_every_derived_number():
    s = _plan("data.prompts_per_step=8", "rollout.n=4").summary()
    assert set(s) == {"roles", "pools", "samples_per_step", "mini_batch_samples", "num_mini_batches",
                      "micro_batch_size_per_rank", "micro_batch_tokens", "use_critic", "use_ref", "rollout_colocated", "recompute_logprobs",
                      "total_steps", "actor_optimizer_steps", "critic_optimizer_steps", "rollout_engine",
                      "val_batch_prompts", "kl_into_score", "rollout_correction", "correction_in_loss", "action_mask",
                      "ref_from_actor", "lora_base_dtype", "lora_base_upcast", "gradient_checkpointing", "actor_autocast", "rollout_compute_dtype", "pipeline",
                      "rank_local", "flash_attention_ok", "rollout_owns_weights"}
    assert s["samples_per_step"] == 32 and s["roles"]["actor"] == "main (dp=1)"
    assert s["rollout_engine"] == {"max_batch": 32, "max_seq_len": 512 + 64}  # schema defaults


def test_disk_bytes_counts_the_checkpoints_held_at_once():
    # 1000 parameters, float32: a checkpoint is 4 + 8 (Adam) bytes a parameter = 12,000 bytes
    p = _plan("trainer.total_steps=10", "trainer.save_every=2", "trainer.keep_last=2")
    assert p.disk_bytes(1000) == 3 * 12_000  # 5 saves; keep_last + the one being written
    p = _plan("trainer.total_steps=10", "trainer.save_every=3", "trainer.keep_last=0")
    assert p.disk_bytes(1000) == 4 * 12_000  # keep all: steps 3, 6, 9 and the last
    p = _plan("trainer.total_steps=10", "trainer.save_every=0", "trainer.export_every=5", "model.dtype=bfloat16")
    assert p.disk_bytes(1000) == 10_000 + 2 * 2_000  # the last checkpoint (2 + 8 bytes) and two bf16 exports
    p = _plan("trainer.total_steps=10", "trainer.save_every=1", "trainer.keep_last=1", "trainer.keep_every=5",
              "algorithm.advantage=gae")
    assert p.disk_bytes(1000) == (2 + 2) * 2 * 12_000  # 2 held + steps 5 and 10 kept; actor and critic
    p = _plan("trainer.total_steps=1000", "trainer.save_every=100", "trainer.keep_last=3", "trainer.keep_every=10")
    assert p.disk_bytes(1000) == 10 * 12_000  # keep_every keeps saved steps only: at most the 10 saves
    p = _plan("trainer.total_steps=10", "trainer.save_every=5", "trainer.keep_last=1", "trainer.delta_checkpoints=int8")
    assert p.disk_bytes(1000) == 2 * (12_000 + 1_000)  # each held checkpoint also holds an int8 delta (1 byte)
