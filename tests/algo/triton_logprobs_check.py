"""Run by test_triton_logprobs.py: algo/triton_logprobs.py against torch's log_softmax on the device it gets
(CUDA, or CPU under TRITON_INTERPRET=1). Exits non-zero on a mismatch."""
import sys

import torch

from fleetrl.algo.triton_logprobs import BLOCK_V, logprobs_from_logits


def check(device: str) -> None:
    torch.manual_seed(0)
    # vocabularies below, at and across block edges; fp32 and bf16 logits; temperatures 0.7 and 1
    for dtype, vocab, temperature in ((torch.float32, BLOCK_V + 907, 0.7), (torch.bfloat16, 2 * BLOCK_V, 1.0),
                                      (torch.float32, 61, 1.0)):
        logits = (torch.randn(37, vocab, device=device) * 3).to(dtype).requires_grad_(True)
        targets = torch.randint(0, vocab, (37,), device=device)
        weights = torch.randn(37, device=device)
        logp, entropy = logprobs_from_logits(logits, targets, temperature)
        (logp * weights).sum().backward()
        got_grad, logits.grad = logits.grad.clone(), None
        ref_all = torch.log_softmax(logits.float() / temperature, -1)
        ref = ref_all.gather(-1, targets[:, None])[:, 0]
        (ref * weights).sum().backward()
        assert not entropy.requires_grad
        torch.testing.assert_close(logp, ref.detach(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(entropy, -(ref_all.exp() * ref_all).sum(-1).detach(), atol=2e-5, rtol=1e-5)
        # bf16 gradients: both sides round the same fp32 value to bf16 (a 1-ulp difference at most)
        tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(got_grad.float(), logits.grad.float(), **tol)


if __name__ == "__main__":
    check(sys.argv[1] if len(sys.argv) > 1 else "cpu")
    print("ok")
