import os
import sys
import time

import pytest
import torch

# Keep every test process light on a 2-core machine: tiny models gain nothing from intra-op threads, and
# OpenMP spin-waiting on a busy 2-core box makes them 10-40x slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)

# The fused head's per-chunk math is one Inductor kernel on CPU (algo/fused_logprobs.py), a C++ compile of ~10 s per
# process and dtype. The tests of the log-prob paths compare the eager ops with references;
# tests/models/test_packing.py checks the compiled kernels against the eager ops, and the SmolLM2 learning test
# trains through them.
from fleetrl.algo import fused_logprobs  # noqa: E402

fused_logprobs.FUSE_ON_CPU = False


# The most expensive modules, costliest first (seconds on the 2-core CI VM at -n 3: `--durations` of the CI runs of
# 2026-11-23). CI runs `-n 3 --dist loadfile` with `--no-loadscope-reorder` (pyproject addopts), so xdist hands
# out whole modules in the order below. Its default order (most tests first) starts these one-to-four-test
# modules last (SmolLM2, ~250 s, was 121st of 123), so one of them can still be running when the other workers
# have nothing left; starting the longest first (LPT) lets the many short modules fill in around them.
LONGEST_FIRST = (
    "tests/integration/test_readme_commands.py",     # 400-775 alone on the shared 2-core box at load 5-14: every
                                                     # README command, 2 one-step SmolLM2 runs, a 6-run sweep
    "tests/integration/test_netns_hosts.py",         # ~400: 4 runs, each with its own 2-host Ray cluster
    "tests/sweep/test_sweep_e2e.py",                 # ~280: sweeps of CLI subprocesses
    "tests/integration/test_smollm2_learning.py",    # ~160 alone, ~300 in CI: 12 GRPO steps of a 135M model
    "tests/integration/test_tool_learning.py",       # ~200: 2 seeds x 60 steps
    "tests/integration/test_learning.py",            # ~180: 3 estimators x 80 steps
    "tests/integration/test_learning_ratio.py",      # ~160: PPO+GAE 120 steps, GSPO 80 steps
    "tests/integration/test_last_checkpoint.py",     # ~135 alone: Ctrl-C of a `fleetrl train` subprocess, its resume
    "tests/engines/test_fast_sampling.py",           # ~60: Triton sampler in the interpreter
    "tests/engines/test_fast_tp.py",                 # ~85: 6 x two spawned gloo processes (tensor parallel)
    "tests/integration/test_async_ops.py",
    "tests/integration/test_async_resume.py",       # ~110 alone: 2 x (straight run, killed CLI run, resume)
    "tests/integration/test_partial_rollouts.py",   # ~70 alone: 5 logged steps (hf), 80 GRPO steps (fast)
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
    _RAY_MODULES.update(_module_path(i.nodeid) for i in items if "ray_local" in getattr(i, "fixturenames", ()))
    _longest_first(items)
    _mark_vllm(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _mark_vllm(items: list[pytest.Item]) -> None:
    """`vllm` tests need the real vLLM, which lives in a second venv (its pins clash with the main one): skipped,
    with the reason, where it is not installed; .ci/run's vLLM stage runs them with FLEETRL_REQUIRE_VLLM=1, where a
    missing vLLM fails instead of skipping."""
    from importlib.util import find_spec

    if find_spec("vllm") is not None:
        return
    if os.environ.get("FLEETRL_REQUIRE_VLLM") == "1":
        raise pytest.UsageError("FLEETRL_REQUIRE_VLLM=1 but vllm is not importable in this environment")
    skip = pytest.mark.skip(reason="needs vLLM (the vllm venv: .ci/run's vLLM stage, docs/engines.md)")
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)


def _longest_first(items: list[pytest.Item]) -> None:
    """The modules of LONGEST_FIRST listed before its first ray_local module; then every ray_local module (those in
    LONGEST_FIRST in its order, then the others, slow first); then the other modules in LONGEST_FIRST, the other
    modules with a slow test, the rest. Each module's tests stay together and in their own order (module-scoped
    fixtures are built once). The ray_local modules come as one block because a worker that runs a module
    without ray_local between two with it shuts the shared Ray down and starts another (~9 s of CPU: 7 to start,
    2 to stop); interleaved as LONGEST_FIRST lists them, the 3 workers started it ~7 times, in one block ~3."""
    first_ray = min((LONGEST_FIRST.index(p) for p in _RAY_MODULES if p in LONGEST_FIRST), default=len(LONGEST_FIRST))
    rank: dict[str, tuple[int, int, int, int]] = {}
    for i, item in enumerate(items):
        path = _module_path(item.nodeid)
        heavy = LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)
        block = 0 if heavy < first_ray else 1 if path in _RAY_MODULES else 2
        first = rank.setdefault(path, (block, heavy, 1, i))
        if "slow" in item.keywords and first[2]:
            rank[path] = (block, heavy, 0, first[3])
    items.sort(key=lambda item: rank[_module_path(item.nodeid)])


# The local Ray of ray_local, shared by consecutive modules that ask for it: {"gcs": its GCS address} while it is up.
_SHARED_RAY: dict[str, str] = {}
# Modules with a test that asks for ray_local (set at collection).
_RAY_MODULES: set[str] = set()


def _module_path(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _shared_ray_up() -> bool:
    """True while this process is connected to the shared local Ray (not to a cluster a module built itself)."""
    ray = sys.modules.get("ray")
    if not _SHARED_RAY or ray is None or not ray.is_initialized():
        return False
    if ray.get_runtime_context().gcs_address != _SHARED_RAY["gcs"]:
        _SHARED_RAY.clear()  # a module shut it down and connected to its own cluster
        return False
    return True


def _shut_shared_ray() -> None:
    if _shared_ray_up():
        sys.modules["ray"].shutdown()
    _SHARED_RAY.clear()


def _ray_is_idle(ray, wait_s: float = 10.0) -> bool:
    """Nothing an earlier module started still holds the shared Ray: every CPU free and no live placement group
    (freed resources show up a moment after a group is removed, hence the short wait)."""
    deadline = time.monotonic() + wait_s
    while True:
        groups = ray.util.placement_group_table().values()
        if (ray.available_resources().get("CPU") == ray.cluster_resources().get("CPU")
                and all(g["state"] == "REMOVED" for g in groups)):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray for the module. Starting one costs ~10 s of wall time and ~8 s of CPU on the 2-core VM, so
    consecutive modules that ask for it share one: it is left running after the module, restarted when the
    module before left something holding it (an actor or placement group), and shut down before a module
    that does not ask for it (_ray_free_module: modules that build their own cluster need the process free of
    it) and at the end of the session. `address="local"` so a stale cluster file can never make a test join
    someone else's cluster."""
    import ray

    if _shared_ray_up() and not _ray_is_idle(ray):
        _shut_shared_ray()
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}})
        _SHARED_RAY["gcs"] = ray.get_runtime_context().gcs_address
    yield ray


@pytest.fixture(scope="module", autouse=True)
def _ray_free_module(request):
    """Autouse, so it runs before the module's own fixtures: a module with no ray_local test starts with the
    shared Ray shut down, as it did when each module shut its own Ray down at its end."""
    if _module_path(request.node.nodeid) not in _RAY_MODULES:
        _shut_shared_ray()
    yield


def pytest_sessionfinish(session, exitstatus):
    _shut_shared_ray()
