import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def _single_torch_thread():
    # The tiny models gain nothing from intra-op threads, and on a busy 2-core machine OpenMP's spin-waiting
    # makes these tests 10-40x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
