import os

import pytest
import torch

# Keep every test process light on a 2-core machine: tiny models gain nothing from intra-op threads, and
# OpenMP spin-waiting on a busy 2-core box makes them 10-40x slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def ray_local():
    """One local Ray per test module (starting one costs ~10 s; modules that build their own cluster need
    the process free of it). `address="local"` so a stale cluster
    file can never make a test join someone else's cluster."""
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}})
    yield ray
    ray.shutdown()
