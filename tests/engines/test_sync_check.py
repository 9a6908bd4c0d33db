"""The policy check's parts (engines/sync_check.py): the probe, the gap, the judgement. Whole runs that skip a
parameter in a sync: tests/integration/test_sync_check.py."""
import copy
import math

import pytest
import torch

from fleetrl.config.schema import SyncCheckConfig
from fleetrl.engines.fast import FastRolloutEngine
from fleetrl.engines.hf import HFRolloutEngine
from fleetrl.engines.sync_check import SyncCheckError, SyncProbe, judge, probe_gap, probe_prompts, sample_probe
from fleetrl.models.logprobs import sequence_logprobs
from fleetrl.models.tiny import build_tiny_model, build_tiny_tokenizer

CFG = SyncCheckConfig(tokens=6, sequences=2, threshold=0.05)


def _trainer_logprobs(model, probe: SyncProbe) -> torch.Tensor:
    with torch.no_grad():
        return sequence_logprobs(model, probe.prompts, probe.prompt_mask, probe.responses, probe.response_mask)[0]


def test_gap_is_the_largest_difference_over_sampled_tokens_only():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    probe = SyncProbe(version=3, rank=0, prompts=torch.zeros(2, 2, dtype=torch.long), prompt_mask=torch.ones(2, 2),
                      responses=torch.zeros(2, 3, dtype=torch.long), response_mask=mask,
                      logprobs=torch.tensor([[-1.0, -2.0, -9.0], [-0.5, 0.0, 0.0]]))
    # |-1 - -1.1| = 0.1, |-2 - -2.05| = 0.05, masked -9 vs 0 ignored, |-0.5 - -0.2| = 0.3
    trainer = torch.tensor([[-1.1, -2.05, 0.0, 0.0], [-0.2, 5.0, 5.0, 0.0]])  # wider than the probe: cut
    assert probe_gap(probe, trainer) == pytest.approx(0.3)


def test_probe_prompts_are_fixed_and_inside_the_vocabulary():
    a, mask = probe_prompts(50, 3)
    b, _ = probe_prompts(50, 3)
    assert torch.equal(a, b) and a.shape == (3, 8) and int(a.max()) < 50 and bool(mask.all())


def test_judge_baseline_mode_names_sync_version_and_gap():
    assert judge([0.01], None, CFG, version=0, where="colocated sync at start-up") == 0.01  # the first sets it
    assert judge([0.02, 0.055], 0.01, CFG, version=1, where="x") == 0.055  # 0.055 <= 0.01 + 0.05
    with pytest.raises(SyncCheckError) as e:
        judge([0.02, 0.3], 0.01, CFG, version=7, where="weight broadcast to pool 'gen' after step 7")
    msg = str(e.value)
    assert "weight broadcast to pool 'gen' after step 7" in msg and "weights version 7" in msg and "0.3" in msg
    assert "rollout worker 1" in msg and "baseline 0.01" in msg and "rollout.sync_check" in msg
    assert (e.value.version, e.value.gap, e.value.restart) == (7, 0.3, False)


def test_judge_absolute_mode_nan_and_restart():
    absolute = SyncCheckConfig(threshold=0.1, mode="absolute", on_mismatch="restart")
    with pytest.raises(SyncCheckError) as e:  # absolute: even the first check can fail
        judge([0.2], None, absolute, version=0, where="x")
    assert e.value.restart and "restarting from the last checkpoint" in str(e.value)
    with pytest.raises(SyncCheckError):  # a NaN weight arrived: NaN is beyond any threshold
        judge([math.nan], 0.0, CFG, version=2, where="x")
    assert judge([1e9], 0.0, SyncCheckConfig(threshold=math.inf), version=2, where="x") == 1e9  # inf: never


@pytest.mark.parametrize("engine", ["hf", "fast"])
def test_engine_probe_matches_the_trainer_and_catches_a_stale_parameter(engine):
    """Both engines' probes score within rounding of the trainer's forward on the same weights, and a parameter
    the engine did not receive (the engine's copy keeps its old value) shows as a gap far beyond the threshold."""
    tok = build_tiny_tokenizer()
    trainer = build_tiny_model(tok)
    rollout = copy.deepcopy(trainer)  # a separate pool's copy
    make = HFRolloutEngine if engine == "hf" else FastRolloutEngine
    eng = make(rollout, tok, device="cpu", seed=0)
    vocab = trainer.config.vocab_size
    probe = sample_probe(eng, vocab, CFG, seed=11, version=0, rank=0)
    assert probe.response_mask.sum() > 0
    baseline = probe_gap(probe, _trainer_logprobs(trainer, probe))
    assert baseline < 1e-4
    with torch.no_grad():  # an update of the trainer; the sync skips one projection
        for p in trainer.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        state = {k: v for k, v in trainer.state_dict().items() if "layers.1.mlp.down_proj" not in k}
    eng.load_weights({**rollout.state_dict(), **state}, 1)
    probe = sample_probe(eng, vocab, CFG, seed=12, version=1, rank=0)
    gap = probe_gap(probe, _trainer_logprobs(trainer, probe))
    with pytest.raises(SyncCheckError, match="weights version 1"):
        judge([gap], baseline, CFG, version=1, where="test sync")
