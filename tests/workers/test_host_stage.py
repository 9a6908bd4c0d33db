"""Actor rank 0's host buffers for the async publish (workers/host_stage.py): each tensor copied exactly into a
buffer of its own, the same buffers reused at the next publish, a new one where a tensor's shape or dtype changed."""
import torch

from fleetrl.workers.host_stage import HostStage


def _named(scale: float) -> list[tuple[str, torch.Tensor]]:
    return [("a", torch.full((2, 3), scale)), ("b", torch.arange(4, dtype=torch.bfloat16) * scale)]


def test_copies_are_exact_and_the_buffers_are_reused():
    stage = HostStage()
    src = _named(1.0)
    first = stage.copy(iter(src))
    assert list(first) == ["a", "b"] and all(torch.equal(first[n], t) for n, t in src)
    assert all(first[n].data_ptr() != t.data_ptr() for n, t in src), "copies, not the caller's tensors"
    ptrs = {n: b.data_ptr() for n, b in first.items()}
    src2 = _named(2.0)
    second = stage.copy(iter(src2))
    assert {n: b.data_ptr() for n, b in second.items()} == ptrs
    assert all(torch.equal(second[n], t) for n, t in src2)


def test_a_changed_shape_or_dtype_gets_a_new_buffer():
    stage = HostStage()
    old = stage.copy(iter(_named(1.0)))["a"]
    new = stage.copy(iter([("a", torch.ones(3, 3, dtype=torch.float16))]))["a"]
    assert new.shape == (3, 3) and new.dtype == torch.float16 and new.data_ptr() != old.data_ptr()
