import os

import pytest
import torch

# Keep every test process light on a 2-core machine: tiny models gain nothing from intra-op threads, and
# OpenMP spin-waiting on a busy 2-core box makes them 10-40x slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)


# The most expensive modules, costliest first (seconds on the 2-core CI VM at -n 3: `--durations` of the CI runs of
# 2026-11-23). CI runs `-n 3 --dist loadfile` with `--no-loadscope-reorder` (pyproject addopts), so xdist hands
# out whole modules in the order below. Its default order (most tests first) starts these one-to-four-test
# modules last (SmolLM2, ~250 s, was 121st of 123), so one of them can still be running when the other workers
# have nothing left; starting the longest first (LPT) lets the many short modules fill in around them.
LONGEST_FIRST = (
    "tests/integration/test_netns_hosts.py",         # ~400: 4 runs, each with its own 2-host Ray cluster
    "tests/sweep/test_sweep_e2e.py",                 # ~280: sweeps of CLI subprocesses
    "tests/integration/test_smollm2_learning.py",    # ~250: 12 GRPO steps of a 135M model
    "tests/integration/test_tool_learning.py",       # ~200: 2 seeds x 60 steps
    "tests/integration/test_learning.py",            # ~180: 3 estimators x 80 steps
    "tests/integration/test_learning_ratio.py",      # ~160: PPO+GAE 120 steps, GSPO 80 steps
    "tests/engines/test_fast_sampling.py",           # ~130: Triton sampler in the interpreter
    "tests/integration/test_async_ops.py",
    "tests/integration/test_watchdog.py",
    "tests/integration/test_reward_model.py",
    "tests/integration/test_lora.py",
    "tests/integration/test_async.py",
    "tests/checkpoint/test_resume.py",
    "tests/integration/test_nothing_lost.py",
    "tests/integration/test_recovery.py",
    "tests/integration/test_reward_model_watchdog.py",
    "tests/integration/test_determinism.py",
)


def pytest_collection_modifyitems(config, items):
    _longest_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _longest_first(items: list[pytest.Item]) -> None:
    """Modules in LONGEST_FIRST, in its order; then the other modules with a slow test; then the rest. Each
    module's tests stay together and in their own order (module-scoped fixtures are built once)."""
    rank: dict[str, tuple[int, int, int]] = {}
    for i, item in enumerate(items):
        path = item.nodeid.split("::", 1)[0]
        heavy = LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)
        first = rank.setdefault(path, (heavy, 1, i))
        if "slow" in item.keywords and first[1]:
            rank[path] = (heavy, 0, first[2])
    items.sort(key=lambda item: rank[item.nodeid.split("::", 1)[0]])


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
