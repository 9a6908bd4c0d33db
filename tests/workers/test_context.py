"""workers/context.py: a worker's tokenizer threads follow its CPU share (share_tokenizer_threads)."""
from __future__ import annotations

import pytest

from fleetrl.workers.context import share_tokenizer_threads


@pytest.fixture
def env(monkeypatch):
    import os

    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # what cluster/runtime.py gives every Ray worker
    monkeypatch.delenv("RAYON_NUM_THREADS", raising=False)
    return os.environ


def test_a_worker_with_four_cpus_decodes_with_four_threads(env):
    share_tokenizer_threads(4, {})
    assert env["TOKENIZERS_PARALLELISM"] == "true" and env["RAYON_NUM_THREADS"] == "4"


def test_a_one_cpu_worker_stays_serial(env):
    share_tokenizer_threads(1, {})
    assert env["TOKENIZERS_PARALLELISM"] == "false" and "RAYON_NUM_THREADS" not in env


def test_cluster_env_wins(env):
    share_tokenizer_threads(4, {"TOKENIZERS_PARALLELISM": "false"})
    assert env["TOKENIZERS_PARALLELISM"] == "false" and "RAYON_NUM_THREADS" not in env
