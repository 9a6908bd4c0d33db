import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from transformers import AutoModelForCausalLM, AutoTokenizer

from fleetrl.checkpoint.export import CheckpointError, export_hf, load_actor_state
from fleetrl.models.hf import load_causal_lm, load_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

PROMPT = "user : copy a b assistant :"


def _perturbed_tiny() -> torch.nn.Module:
    model = load_causal_lm("tiny:")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model


def _write_checkpoint(step_dir: Path, model: torch.nn.Module, *, model_path: str = "tiny:",
                      extra: dict | None = None) -> Path:
    """The layout fleetrl/checkpoint/manager.py writes: actor/ (DCP of the plain state_dict) + meta.json."""
    step_dir.mkdir(parents=True)
    dcp.save({"model": model.state_dict(), **(extra or {})}, checkpoint_id=str(step_dir / "actor"))
    meta = {"step": 3, "model_path": model_path, "tokenizer_path": "tiny:", "dtype": "float32"}
    (step_dir / "meta.json").write_text(json.dumps(meta))
    return step_dir


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    model = _perturbed_tiny()
    return _write_checkpoint(tmp_path_factory.mktemp("out") / "checkpoints" / "step_3", model), model


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = load_tokenizer("tiny:")(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_load_actor_state_returns_the_saved_weights(trained):
    ckpt, model = trained
    state = load_actor_state(ckpt)
    base = load_causal_lm("tiny:").state_dict()
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert not torch.equal(state["lm_head.weight"], base["lm_head.weight"])  # not just the base model back


def test_export_hf_round_trip_gives_the_same_logits_and_tokens(trained, tmp_path):
    ckpt, model = trained
    out = export_hf(ckpt, tmp_path / "hf")
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in out.iterdir()}
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    torch.testing.assert_close(_logits(loaded), _logits(model), atol=1e-6, rtol=0)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer(PROMPT).input_ids == load_tokenizer("tiny:")(PROMPT).input_ids
    assert loaded.generation_config.eos_token_id == tokenizer.eos_token_id


def test_other_entries_in_the_actor_folder_are_ignored(tmp_path):
    model = _perturbed_tiny()
    optim = {"state": {name: {"exp_avg": torch.ones_like(p)} for name, p in model.named_parameters()}}
    ckpt = _write_checkpoint(tmp_path / "step_1", model, extra={"optim": optim})
    state = load_actor_state(ckpt)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_export_hf_converts_dtype(trained, tmp_path):
    ckpt, model = trained
    loaded = AutoModelForCausalLM.from_pretrained(export_hf(ckpt, tmp_path / "hf", dtype="bfloat16"))
    assert loaded.dtype == torch.bfloat16
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight.to(torch.bfloat16))


def test_missing_meta_names_the_path_and_points_at_the_latest_step(trained):
    ckpt, _ = trained
    run_dir = ckpt.parent.parent  # OUT/, a common thing to pass by mistake
    (ckpt.parent / "step_4.tmp").mkdir()  # a save in progress is not the latest checkpoint
    with pytest.raises(CheckpointError, match=r"no meta\.json.*step_3'"):
        export_hf(run_dir, run_dir / "hf")


def test_missing_or_interrupted_actor_folder_is_reported(tmp_path):
    step = tmp_path / "step_1"
    step.mkdir()
    (step / "meta.json").write_text(json.dumps({"step": 1, "model_path": "tiny:", "tokenizer_path": "tiny:",
                                                "dtype": "float32"}))
    with pytest.raises(CheckpointError, match=r"incomplete.*actor.*does not exist.*earlier step_N"):
        load_actor_state(step)
    (step / "actor").mkdir()
    with pytest.raises(CheckpointError, match=r"incomplete.*has no \.metadata"):
        load_actor_state(step)


def test_meta_without_required_keys_is_reported(tmp_path):
    (tmp_path / "meta.json").write_text(json.dumps({"step": 1}))
    with pytest.raises(CheckpointError, match=r"lacks \['model_path', 'tokenizer_path', 'dtype'\]"):
        load_actor_state(tmp_path)


def test_checkpoint_of_another_model_is_reported(tmp_path):
    ckpt = _write_checkpoint(tmp_path / "step_1", load_causal_lm("tiny:"), model_path="tiny:hidden=32,heads=2")
    with pytest.raises(CheckpointError, match=r"does not match the model named by meta\.json.*different shape"):
        load_actor_state(ckpt)
