"""The e2e benchmark's model-FLOP count (bench/e2e.py), by hand: MFU figures in bench/RESULTS.md rest on it."""
from bench.e2e import _update_mfu, update_flops


def test_update_flops_by_hand():
    # body 10 params over 7 computed tokens, head 3 params over 4 response tokens, attention 2 per pair over
    # Σ len² = 25: 6*10*7 + 6*3*4 + 2*25 = 420 + 72 + 50.
    assert update_flops(10, 3, 2, body_tokens=7, response_tokens=4, sum_len_sq=25) == 542


def test_mfu_counts_the_head_on_response_tokens_only_and_shared_prompts_once():
    # 0.5B shape, 256 samples of 126 + 256 tokens, 1 s update on an H200 (989 TFLOP/s bf16 dense).
    stats = [{"tokens": 256 * 382, "response_tokens": 256 * 256, "sum_len_sq": 256 * 382 ** 2}]
    full = _update_mfu(stats, 1.0, "random:qwen2.5-0.5b", "NVIDIA H200", 1)
    shared = _update_mfu(stats, 1.0, "random:qwen2.5-0.5b", "NVIDIA H200", 1, body_tokens=32 * 126 + 256 * 256)
    # body 358.0M (494.0M matmul params - 136.1M head) x 97,792 + head x 65,536, x 6, + attention 9.6 TFLOP
    assert 0.27 < full < 0.28 and 0.21 < shared < 0.22
