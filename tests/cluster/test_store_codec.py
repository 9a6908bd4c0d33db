"""The async weight path's object-store form (cluster/store_codec.py): numpy arrays of the tensors' bytes, so Ray
stores them out of band and reads them back as views; every dtype comes back bit for bit."""
import numpy as np
import pytest
import torch

from fleetrl.cluster.store_codec import from_store, to_store


def test_every_dtype_comes_back_bit_for_bit_as_a_view_of_the_arrays():
    named = {"bf16": torch.randn(3, 5).to(torch.bfloat16), "fp32": torch.randn(4), "fp16": torch.randn(2, 2).half(),
             "long": torch.arange(6).view(2, 3), "bool": torch.tensor([True, False, True]),
             "strided": torch.randn(4, 6)[:, ::2]}
    stored = to_store(named)
    assert all(isinstance(arr, np.ndarray) for arr, _ in stored.values())  # no torch object left to pickle
    assert stored["bf16"][1] == "bfloat16" and stored["bf16"][0].dtype == np.int16
    back = from_store(stored)
    for name, t in named.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape, name
        assert torch.equal(back[name], t), name
    assert back["fp32"].data_ptr() == stored["fp32"][0].ctypes.data, "a view of the array, not a copy"


def test_read_only_arrays_from_the_store_give_tensors_without_a_warning(recwarn):
    arr, dtype = to_store({"w": torch.ones(2, 2, dtype=torch.bfloat16)})["w"]
    arr.setflags(write=False)  # what ray.get hands back
    out = from_store({"w": (arr, dtype)})["w"]
    assert torch.equal(out, torch.ones(2, 2, dtype=torch.bfloat16)) and not recwarn.list


def test_a_gpu_tensor_is_refused_with_what_to_do():
    with pytest.raises(ValueError, match="copy it to the host first"):
        to_store({"w": torch.empty(1, device="meta")})
