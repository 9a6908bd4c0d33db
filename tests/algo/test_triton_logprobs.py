"""algo/triton_logprobs.py: log-probs, entropy and the logits' gradient equal torch's log_softmax path, on the GPU
(marked gpu) and in Triton's interpreter on CPU (where triton is installed); and the model-level switch."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).with_name("triton_logprobs_check.py")
ROOT = str(Path(__file__).resolve().parents[2])


@pytest.mark.gpu
def test_triton_logprobs_equal_torch_on_the_gpu() -> None:
    from tests.algo.triton_logprobs_check import check

    check("cuda")


@pytest.mark.slow
def test_triton_logprobs_equal_torch_in_the_interpreter() -> None:
    """The CPU stand-in for the GPU test above (only where triton is installed and no GPU runs the real kernel:
    on a CUDA machine the interpreter failed once, unexplained; the GPU test passed there)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device runs the kernels for real (test_triton_logprobs_equal_torch_on_the_gpu)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, str(SCRIPT), "cpu"], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.gpu
def test_sequence_logprobs_take_the_triton_path_and_agree_with_torch() -> None:
    import fleetrl.models.logprobs as lp_mod
    from fleetrl.models.hf import load_causal_lm

    model = load_causal_lm("tiny:").cuda().train()
    prompts = torch.tensor([[5, 6, 7, 8], [0, 9, 10, 11]], device="cuda")
    responses = torch.tensor([[12, 13, 14], [15, 16, 1]], device="cuda")
    ones_p, ones_r = (prompts > 0).long(), torch.ones_like(responses)

    def run(triton: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lp_mod.TRITON_LOGPROBS = triton
        model.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logp, ent = lp_mod.sequence_logprobs(model, prompts, ones_p, responses, ones_r, temperature=0.8,
                                                 return_entropy="metric", chunk_size=2)
        logp.sum().backward()
        return logp.detach(), ent, model.lm_head.weight.grad.clone()

    try:
        got, want = run(True), run(False)
    finally:
        lp_mod.TRITON_LOGPROBS = True
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[2], want[2], atol=1e-3, rtol=1e-2)
