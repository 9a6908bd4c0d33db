"""Environment episodes through the trainer: environment tokens have zero weight in every loss term, and faults
(a malformed tool call, an environment that raises, one that hangs) are counted while the run goes on."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from fleetrl.config import derive_plan, load_config, to_dict
from fleetrl.tracking.tracker import Tracker
from fleetrl.trainer.trainer import SEQ_KEYS, Trainer
from fleetrl.workers.messages import MiniBatchCounts, UpdateSpec
from tests.integration.helpers import train_run

EXAMPLE = "examples/tools_lookup_tiny.yaml"
# Pinned here rather than taken from the example (tuned for learning): 4 tokens per turn, where the untrained
# policy calls the tool in some of 16 episodes.
SMALL = ["cluster.backend=local", "data.prompts_per_step=4", "rollout.n=4", "algorithm.micro_batch_size=16",
         "trainer.total_steps=2", "tracking.progress=false", "tracking.console=false", "data.val=null",
         "model.path=tiny:hidden=128", "rollout.max_new_tokens=4", "rollout.env.max_total_tokens=24"]


@pytest.fixture
def trainer(tmp_path: Path):
    # KL in the loss, an entropy bonus and two mini-batches (so old log-probs are recomputed): every term that
    # reads a mask is live.
    cfg = load_config(EXAMPLE, [*SMALL, "algorithm.kl.placement=loss", "algorithm.kl.coef=0.5",
                                "algorithm.entropy_coef=0.1", "algorithm.mini_batch_prompts=2",
                                f"trainer.output_dir={tmp_path}"])
    t = Trainer(derive_plan(cfg), Tracker(tmp_path, cfg.tracking, to_dict(cfg), cfg.trainer.name), tmp_path)
    t.build_groups()
    yield t
    t.shutdown()
    t.tracker.close()


def _loss_and_grads(actor, batch, spec: UpdateSpec) -> tuple[float, list[torch.Tensor]]:
    actor.model.zero_grad(set_to_none=True)
    loss, _ = actor._loss(batch, spec.minis[0], spec)
    loss.backward()
    grads = [p.grad.detach().clone() for p in actor.model.parameters() if p.grad is not None]
    actor.model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def test_env_tokens_have_zero_weight_in_loss_kl_entropy_and_gradients(trainer: Trainer):
    t = trainer
    batch = t.advantages(t.values(t.logprobs(t.rollouts())))
    env = batch["response_mask"].bool() & ~batch["loss_mask"].bool()
    assert env.any(), "the untrained policy called the tool in none of 16 episodes; the test needs some"
    assert (batch["advantages"][env] == 0).all()  # advantages live on model tokens only
    keys = [*SEQ_KEYS, "advantages", "rollout_logprobs", "old_logprobs", "ref_logprobs", "loss_mask"]
    base = batch.pick(*keys)
    # Garbage at environment positions in every per-token input the loss reads besides the forward pass.
    bumped = base.with_tensors(**{k: base[k].masked_fill(env, v) for k, v in
                                  (("old_logprobs", -3.0), ("ref_logprobs", 7.0), ("advantages", -9.0),
                                   ("rollout_logprobs", 5.0))})
    counts = MiniBatchCounts(num_tokens=float(base["loss_mask"].sum()), num_seqs=float(len(base)), norm_len=8.0)
    actor = t.group("actor").workers[0].actor
    for mask_key, same in (("loss_mask", True), ("response_mask", False)):
        spec = UpdateSpec(minis=(counts,), kl_coef=0.5, old_logprobs="recomputed", loss_mask=mask_key)
        loss, grads = _loss_and_grads(actor, base, spec)
        loss_b, grads_b = _loss_and_grads(actor, bumped, spec)
        unchanged = loss == loss_b and all(torch.equal(g, h) for g, h in zip(grads, grads_b))
        # With the env mask nothing moves, bit for bit; weighing by response_mask (the control) it does.
        assert unchanged == same, f"mask {mask_key}: loss {loss} vs {loss_b}"


FLAKY_ENV = textwrap.dedent('''
    import time

    from fleetrl.envs.tool_env import lookup_env


    class Flaky:
        """Turn 1 raises; turn 2 sends the lookup tool a malformed call; turn 3 hangs past the deadline."""

        def __init__(self, hang_s=3.0):
            self.tools, self.turn, self.hang_s = lookup_env(), 0, hang_s

        def reset(self, sample):
            self.tools.reset(sample)

        def step(self, action):
            self.turn += 1
            if self.turn == 1:
                raise RuntimeError("flaky environment")
            if self.turn == 2:
                return self.tools.step("? a b")  # '? KEY' has one argument: a parse error
            time.sleep(self.hang_s)
''')


def test_malformed_call_raising_and_hanging_env_are_counted_and_training_continues(tmp_path: Path):
    spec = tmp_path / "flaky_env.py"
    spec.write_text(FLAKY_ENV)
    records = train_run(EXAMPLE, tmp_path / "run", *SMALL, f"rollout.env.name={spec}:Flaky",
                        "rollout.env.kwargs={}", "rollout.env.max_turns=4", "rollout.env.max_total_tokens=96",
                        "rollout.env.timeout_s=0.5", "rollout.max_new_tokens=2")
    steps = [r for r in records if "train/env/turns" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        # Every episode: turn 1 raises (1 env error), turn 2 is a malformed call (1 call, 1 tool error),
        # turn 3 passes its 0.5 s deadline (1 timeout, the episode ends there): 3 turns, reward 0.
        assert r["train/env/turns"] == 3 and r["train/env/env_errors"] == 1
        assert r["train/env/tool_calls"] == 1 and r["train/env/tool_errors"] == 1
        assert r["train/env/timeouts"] == 1 and r["train/env/finish_timeout"] == 1.0
        assert r["train/reward_mean"] == 0.0 and 0 < r["train/env/env_token_share"] < 1
