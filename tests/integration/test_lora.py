"""actor.lora through the real Ray workers: the copy task is learned (< 20% -> > 80% held-out, as the full
fine-tuning estimators in test_learning.py; with an entropy bonus, see below); a LoRA checkpoint holds the adapters only and resumes exactly
(6 steps straight == 3 + resume + 3, PPO with a critic and a KL reference that is the actor with its adapters
off); a separate rollout pool receives the merged adapted projections and nothing else."""
import pytest
import torch
import torch.distributed.checkpoint as dcp

from fleetrl.cluster.weight_sync import broadcast_weights
from fleetrl.config import derive_plan, load_config
from fleetrl.tracking.tracker import Tracker
from fleetrl.trainer.metric_names import is_machine_metric
from fleetrl.trainer.trainer import Trainer
from fleetrl.workers.worker import Worker
from tests.integration.helpers import train_run, val_curve

pytestmark = pytest.mark.slow
# The tiny model is random-init: with its head frozen, a unit-RMS hidden state against head rows of norm
# 0.02 * sqrt(128) ~ 0.23 reaches logits of about 2.6 at most, p <= ~0.2 over 52 tokens, so the (untied) head is
# adapted too. Tuned (quickstart, seed 0, targets [all-linear, lm_head], greedy val at steps 0, 25, ..., 150):
#   rank 16 / alpha 32, lr 1e-3:  .04 .10 .45 .63 .79 .79 .79     (best; the same curve through Ray and local)
#   rank 16 / alpha 32, lr 5e-4:  .04 .10 .10 .35 .61 .79 .79
#   rank 16 / alpha 32, lr 2e-3:  .04 .37 .59 .63 .63 .53 .63     lr 3e-3: .58 at 100
#   rank 32 / alpha 64, lr 1e-3:  .04 .23 .63 .64 .69 .69 .69     rank 64 / alpha 128: .63 from step 50
#   rank  8 / alpha 16, lr 1e-3:  .04 .10 .10 .35 .35 .66 .66     lr 1e-2 (any rank): entropy collapse, <= .19
# Full fine-tuning reaches 1.0 by step 80; with frozen random embeddings LoRA plateaus at 79/100.
# More tried (local backend, greedy val at 25, 50, 75, 100[, 125, 150]):
#   rank 16 / alpha 128, lr 5e-4:                       .13 .63 .66 .79
#   rank 16 / alpha 32, lr 2e-3 cosine to 2e-4:          .36 .63 .63 (150-step schedule, stopped at 75)
#   rank 16 / alpha 32, lr 1e-3, Adam betas (.9, .99):   .10 .45 .63 (stopped at 75)
#   + a LoRA on embed_tokens (peft Embedding, untied):  .20 .50 .70 .70
# At .79 the greedy answer per digit is right for 0, 3, 4, 5, 6, 8, 9 and "6" for 1, 2 and 7 (both first rows
# alike), and the policy's entropy has collapsed: all n samples of a 1-prompt answer "6", their advantages are 0,
# and nothing moves them. Keeping exploration alive gets past it (2026-11-23, local backend, 100 steps):
#   + algorithm.entropy_coef=0.01:   .04 .10 .58 .84 .87   (seed 0); .04 .12 .67 .90 .94 (seed 1)
#   + rollout.n=16 (no bonus):       .04 .11 .61 .94 .94   (seed 0; twice the samples per step)
LORA = ("actor.lora={rank: 16, alpha: 32, targets: [all-linear, lm_head]}", "actor.optim.lr=0.001")
LEARN = (*LORA, "algorithm.entropy_coef=0.01")
RESUME = ("model.path=tiny:", "data.prompts_per_step=8", "rollout.n=4", "algorithm.mini_batch_prompts=4",
          "algorithm.micro_batch_size=8", "algorithm.ppo_epochs=2", "trainer.val_every=3", "data.val_max_prompts=16",
          "trainer.save_every=3", "trainer.keep_last=0", "trainer.delta_checkpoints=exact", *LORA)


def test_lora_learns_the_copy_task(tmp_path, ray_local):
    curve = val_curve(train_run("examples/quickstart.yaml", tmp_path / "lora", *LEARN,
                                "trainer.total_steps=100", "trainer.val_every=25"))
    assert curve[0] < 0.2, f"initial held-out success {curve[0]} should start below 20%"
    assert curve[-1] > 0.8, f"held-out success curve {curve} did not pass 80%"


def _saved(ckpt, role):
    reader = dcp.FileSystemReader(str(ckpt / role))
    meta = reader.read_metadata()
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.state_dict_metadata.items()
             if hasattr(v, "size")}
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def _steps(records, lo, hi):
    return [{k: v for k, v in r.items() if not is_machine_metric(k)}
            for r in records if "event" not in r and lo <= r["step"] <= hi and any(k.startswith("train/") for k in r)]


def test_lora_checkpoint_resumes_exactly(tmp_path, ray_local):
    straight = train_run("examples/ppo_tiny.yaml", tmp_path / "a", *RESUME, "trainer.total_steps=6")
    train_run("examples/ppo_tiny.yaml", tmp_path / "b", *RESUME, "trainer.total_steps=3")
    resumed = train_run("examples/ppo_tiny.yaml", tmp_path / "b", *RESUME, "trainer.total_steps=6",
                        "trainer.resume=auto")
    assert any(r.get("event") == "resumed" for r in resumed)
    assert _steps(resumed, 4, 6) == _steps(straight, 4, 6) and len(_steps(straight, 4, 6)) == 3
    a, b = (_saved(p / "checkpoints" / "step_6", "actor") for p in (tmp_path / "a", tmp_path / "b"))
    model_keys = [k for k in a if k.startswith("model.")]
    # tiny: (2 layers x 7 projections + the head) x (lora_A, lora_B) = 30: the frozen base is not in the checkpoint
    assert len(model_keys) == 30 and all(".lora_" in k for k in model_keys)
    assert any(k.startswith("optim.state.") for k in a)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"actor {k} differs after resume"
    _exports_agree(tmp_path / "a" / "checkpoints" / "step_6", tmp_path / "export")


def _exports_agree(ckpt, out):
    """`fleetrl export` (adapters merged) and `--from-deltas` (base + the merged projections the deltas hold)
    write the same full weights."""
    from safetensors.torch import load_file

    from fleetrl.checkpoint.delta import load_delta
    from fleetrl.checkpoint.export import export_hf
    from fleetrl.checkpoint.manager import export_via_deltas

    # the deltas hold the adapted weights only: 2 layers x 7 projections + the head
    assert len(load_delta(ckpt / "delta.safetensors").entries) == 15
    merged = load_file(export_hf(ckpt, out / "merged") / "model.safetensors")
    rebuilt = load_file(export_via_deltas(ckpt, out / "deltas") / "model.safetensors")
    assert merged.keys() == rebuilt.keys() and not any("lora" in k for k in merged)
    for k in merged:
        assert torch.equal(merged[k], rebuilt[k]), k


def test_separate_rollout_pool_receives_merged_projections(tmp_path, ray_local):
    split = ["cluster.pools={train: {cpus_per_worker: 0.5}, gen: {cpus_per_worker: 0.5}}",
             "cluster.roles={actor: train, rollout: gen}", "model.path=tiny:", "data.prompts_per_step=8",
             "actor.optim.lr=0.01", "tracking.console=false", "cluster.init_timeout_s=90",
             "algorithm.micro_batch_size=16", "actor.lora={rank: 4, targets: [q_proj, v_proj]}"]
    cfg = load_config("examples/quickstart.yaml", split)
    t = Trainer(derive_plan(cfg), Tracker(tmp_path, cfg.tracking, {}, "ws"), tmp_path)
    try:
        t.build_groups()
        batch = t.score(t.generate(t.train_feed.next_batch(8)))
        batch.tensors["scores"] = (torch.arange(len(batch)) % 2).float()
        t.update(t.advantages(t.logprobs(batch)))
        assert _rollout_vs_actor(t) > 1e-3, "before the sync the rollout still has the base weights"
        sent = broadcast_weights(t.group("actor"), t.group("rollout"), 1, cfg.cluster.init_timeout_s)
        # q_proj and v_proj of 2 layers, each 64 x 64 fp32: 2 * 2 * 64 * 64 * 4 bytes
        assert sent == 65536
        assert _rollout_vs_actor(t) < 1e-5
    finally:
        t.shutdown()


def _rollout_vs_actor(t: Trainer) -> float:
    batch = t.generate(t.train_feed.next_batch(8))
    actor = t.group("actor").call_split(Worker.compute_logprobs, batch.pick("prompts", "prompt_mask", "responses",
                                                                           "response_mask"))
    mask = batch["response_mask"].float()
    return float(((batch["rollout_logprobs"] - actor["old_logprobs"]).abs() * mask).max())


def test_lora_under_autocast_keeps_a_narrow_base_and_every_pass_reads_it(tmp_path):
    # Plan.lora_base_dtype: the frozen projections are kept in bf16, so the recomputed old log-probs (2 mini-
    # batches) and the KL reference (the actor with adapters off) must run under the update's autocast too; with
    # B = 0 at step 1 both compute the base model's function in the same precision: the KL is exactly 0.
    run = ("model.path=tiny:", "cluster.backend=local", "data.prompts_per_step=4", "rollout.n=4",
           "algorithm.mini_batch_prompts=2", "algorithm.micro_batch_size=4", "algorithm.kl.placement=loss",
           "trainer.total_steps=2", "trainer.val_every=0", "actor.lora={rank: 4, alpha: 8}",
           "actor.autocast=bfloat16", "rollout.engine=fast")
    assert derive_plan(load_config(None, list(run))).lora_base_dtype == "bfloat16"
    steps = [r for r in train_run(None, tmp_path / "narrow", *run) if "train/kl" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert steps[0]["train/kl"] == 0.0
    assert all(abs(r["train/actor/ratio_mean"] - 1) < 1e-3 and r["train/actor/clip_frac"] == 0.0 for r in steps)
