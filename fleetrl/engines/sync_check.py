"""The policy check after every weight sync: does the rollout engine now sample from the policy being trained?

A sync can go wrong silently: LoRA adapters left out of the merge, a tied head that arrives under no name the
engine reads, a bucket of sharded tensors never gathered. Generation still works; it samples from other weights
than the trainer's and the run trains off-policy without an error (a peer framework's LoRA sync sampled from the
initial policy for two months). So after each sync every rollout worker samples a short probe (`sequences` rows of
`tokens` new tokens from fixed prompts, seeded by version and rank) and keeps the engine's log-probs; the trainer
scores the same tokens with its own forward; the gap is the largest |engine - trainer| over those tokens. The
controller sees that one number per worker.

Why sampled tokens rather than arbitrary ones (vLLM's probe, engines/vllm/check.py): they are where the policy puts
its mass, so where a wrong weight changes what is trained on; arbitrary tokens of a trained model sit in the far
tail of its distribution, where honest rounding gaps (bf16) are largest.

The threshold follows engines/vllm/check.py: the baseline is the run's first gap, measured before any update (or
restored from the checkpoint on resume), when the engine and the trainer hold the same weights by construction; it
is the two implementations' honest rounding difference (0 for the colocated hf engine, ~1e-6 for the fast engine in
fp32, ~1e-2 in bf16). A gap beyond baseline + threshold (default 0.05, vLLM's tolerance) is a SyncCheckError;
mode=absolute compares the gap with the threshold alone.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from fleetrl.config.schema import SyncCheckConfig
from fleetrl.engines.protocol import RolloutEngine, SamplingParams

PROBE_SEED = 20_261_127  # the probe prompts' token ids depend only on this, the vocabulary size and the shape
PROMPT_TOKENS = 8


class SyncCheckError(RuntimeError):
    """The rollout engine's log-probs after a sync differ from the trainer's: the engine does not hold the trained
    weights. `restart` (rollout.sync_check.on_mismatch=restart): the supervisor resumes from the last checkpoint."""

    def __init__(self, message: str, *, version: int, gap: float, restart: bool) -> None:
        super().__init__(message)
        self.version, self.gap, self.restart = version, gap, restart


@dataclass(frozen=True)
class SyncProbe:
    """What a rollout worker sampled after the sync to `version`; crosses from a rollout worker to the actor's ranks
    (a few hundred bytes). prompts/prompt_mask [S, PROMPT_TOKENS]; responses/response_mask/logprobs [S, R], the
    engine's log softmax(logits) of each sampled token in fp32 (temperature 1)."""

    version: int
    rank: int
    prompts: torch.Tensor
    prompt_mask: torch.Tensor
    responses: torch.Tensor
    response_mask: torch.Tensor
    logprobs: torch.Tensor


def probe_prompts(vocab_size: int, sequences: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[sequences, PROMPT_TOKENS] token ids drawn by a fixed generator (the same prompts at every sync), and its
    all-ones mask."""
    g = torch.Generator().manual_seed(PROBE_SEED)
    ids = torch.randint(0, vocab_size, (sequences, PROMPT_TOKENS), generator=g)
    return ids, torch.ones_like(ids)


def sample_probe(engine: RolloutEngine, vocab_size: int, cfg: SyncCheckConfig, *, seed: int, version: int,
                 rank: int) -> SyncProbe:
    """The engine samples the probe at temperature 1 (no top-k/top-p: every engine reports plain log-softmax)."""
    prompts, mask = probe_prompts(vocab_size, cfg.sequences)
    out = engine.generate(prompts, mask, SamplingParams(max_new_tokens=cfg.tokens, temperature=1.0, seed=seed))
    return SyncProbe(version=version, rank=rank, prompts=prompts, prompt_mask=mask, responses=out.responses.cpu(),
                     response_mask=out.response_mask.long().cpu(), logprobs=out.logprobs.float().cpu())


def probe_gap(probe: SyncProbe, trainer_logprobs: torch.Tensor) -> float:
    """max |engine - trainer| log-prob over the probe's sampled tokens (trainer_logprobs [S, R'], R' >= R)."""
    mask = probe.response_mask.bool()
    ours = trainer_logprobs[:, :mask.shape[1]].float().cpu()
    return float((probe.logprobs - ours).abs()[mask].max()) if mask.any() else 0.0


def judge(gaps: Sequence[float], baseline: float | None, cfg: SyncCheckConfig, *, version: int, where: str,
          measured: str | None = None) -> float:
    """The largest of the rollout workers' gaps; raises SyncCheckError when it is beyond the threshold. `baseline`:
    the run's first gap (None: this is the first, which only an absolute threshold can fail). `where` names the
    sync (e.g. "colocated sync", "weight broadcast to pool 'gen'"); `measured` says what the gap is, when it is not
    the probe's largest (source=step: the step's mean)."""
    # A NaN gap (a NaN weight arrived) ranks above every number and passes no threshold.
    worst = max(range(len(gaps)), key=lambda r: math.inf if math.isnan(gaps[r]) else gaps[r])
    gap = gaps[worst]
    limit = cfg.threshold if cfg.mode == "absolute" else None if baseline is None else baseline + cfg.threshold
    if limit is None or gap <= limit:
        return gap
    rule = ("the absolute threshold" if cfg.mode == "absolute"
            else f"the run's baseline {baseline:.3g} + threshold")
    measured = measured or f"up to {gap:.4g} (rollout worker {worst}, {cfg.sequences}x{cfg.tokens} sampled tokens)"
    raise SyncCheckError(
        f"policy check failed: {where}, weights version {version}: the rollout engine's log-probs differ "
        f"from the trainer's by {measured}, beyond {rule} {cfg.threshold:g} (rollout.sync_check): the engine does "
        f"not hold the trained weights, so its samples would be off-policy. Likely a parameter the sync skipped (LoRA adapters, a tied "
        f"head, a bucket of sharded tensors); "
        + ("restarting from the last checkpoint (rollout.sync_check.on_mismatch=restart)" if cfg.on_mismatch ==
           "restart" else "set rollout.sync_check.on_mismatch=restart to resume from the last checkpoint instead"),
        version=version, gap=gap, restart=cfg.on_mismatch == "restart")
