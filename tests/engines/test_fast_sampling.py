"""The fast engine's samplers (engines/fast/sampling.py): draws follow softmax(logits / T) (chi-square over a small
vocab, fixed seed), the reported log-probs are exact, and a row's draw depends on its request, not its slot."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fleetrl.engines.fast.sampling import SamplerKey, sample_torch

ROWS = 20_000
# Chi-square critical values at p = 0.001 (df = categories - 1): a correct sampler exceeds them one time in a
# thousand seeds; the seed is fixed, so the test is deterministic and was not tuned to pass.
CHI2_001 = {3: 16.27, 4: 18.47, 7: 24.32}
LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, -3.0])


def _draw(key: SamplerKey, temperature: float, logits: torch.Tensor = LOGITS, seed: int = 99):
    rows = logits[None].repeat(ROWS, 1)
    req = torch.arange(ROWS)
    tok, lp = sample_torch(rows, key, torch.tensor([temperature]), torch.tensor([seed]), req, torch.zeros_like(req))
    return tok, lp, rows


def _chi2(tok: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tok, minlength=probs.numel()).double()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token outside the allowed set was drawn"
    expected = probs.double()[keep] * tok.numel()
    return float(((counts[keep] - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_plain_sampling_follows_the_softmax(temperature: float) -> None:
    tok, lp, rows = _draw(SamplerKey(False), temperature)
    probs = torch.softmax(LOGITS / temperature, 0)
    assert _chi2(tok, probs) < CHI2_001[7]
    # exact log-probs: log_softmax(logits / T) at the drawn token (fp32)
    torch.testing.assert_close(lp, torch.log_softmax(rows / temperature, -1).gather(1, tok[:, None])[:, 0],
                               atol=1e-6, rtol=0)


def test_top_k_and_top_p_draw_from_the_renormalised_set() -> None:
    # top_k=4 keeps logits 2.0, 1.5, 1.0, 0.5 (ids 0, 6, 1, 2).
    tok, lp, rows = _draw(SamplerKey(False, top_k=4), 1.0)
    kept = torch.zeros(8, dtype=torch.bool)
    kept[[0, 6, 1, 2]] = True
    probs = torch.softmax(LOGITS.masked_fill(~kept, float("-inf")), 0)
    assert _chi2(tok, probs) < CHI2_001[3]
    # the log-prob stays over the UNfiltered logits (the protocol's rule)
    torch.testing.assert_close(lp, torch.log_softmax(rows, -1).gather(1, tok[:, None])[:, 0], atol=1e-6, rtol=0)
    # top_p=0.85: softmax(LOGITS) sorted is 0.405 (id 0), 0.245 (6), 0.149 (1), 0.090 (2), 0.055, ...; the sums
    # before each token are 0, 0.405, 0.650, 0.799 < 0.85, then 0.889 >= 0.85: ids 0, 6, 1, 2 stay, the rest go
    tok, _, _ = _draw(SamplerKey(False, top_p=0.85), 1.0)
    assert _chi2(tok, probs) < CHI2_001[3]


def test_greedy_is_the_argmax_with_the_temperature_one_logprob() -> None:
    tok, lp, _ = _draw(SamplerKey(True), 1.0)
    assert bool((tok == 0).all())
    torch.testing.assert_close(lp, torch.log_softmax(LOGITS, 0)[0].expand(ROWS), atol=1e-6, rtol=0)


def test_a_draw_depends_on_the_request_not_the_row() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    req, count = torch.tensor([4, 9, 1, 7, 3, 0]), torch.tensor([2, 0, 5, 1, 1, 3])
    args = (SamplerKey(False), torch.tensor([1.0]), torch.tensor([5]))
    tok, lp = sample_torch(logits, *args[:2], args[2], req, count)
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    tok_p, lp_p = sample_torch(logits[perm], *args[:2], args[2], req[perm], count[perm])
    assert torch.equal(tok_p, tok[perm]) and torch.equal(lp_p, lp[perm])


SCRIPT = Path(__file__).with_name("triton_sampling_check.py")


@pytest.mark.slow  # ~45 s alone on 2 cores: the interpreter runs each Triton program in numpy
def test_triton_sampler_in_the_interpreter() -> None:
    """The Triton sampler on CPU via TRITON_INTERPRET=1 (only where triton is installed; CUDA CI runs the
    kernels for real in bench/decode.py --check)."""
    pytest.importorskip("triton")
    root = str(Path(__file__).resolve().parents[2])  # this checkout's fleetrl and tests, not an installed copy
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
