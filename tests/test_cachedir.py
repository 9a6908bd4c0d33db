"""The user cache directory and the per-node compile caches every worker of a node shares (fleetrl/cachedir.py)."""
import os
import socket

from fleetrl.cachedir import use_node_compile_cache, user_cache_dir


def test_compile_caches_point_at_one_directory_per_node_unless_already_named(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEETRL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", "/elsewhere/triton")  # set by the user (cluster.env): kept
    node = tmp_path / "compile" / socket.gethostname()
    assert user_cache_dir("compile", socket.gethostname()) == node
    assert use_node_compile_cache() == {"TORCHINDUCTOR_CACHE_DIR": str(node / "inductor")}
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(node / "inductor") and (node / "inductor").is_dir()
    assert os.environ["TRITON_CACHE_DIR"] == "/elsewhere/triton"
    assert use_node_compile_cache() == {}  # a second worker in the process: nothing left to set
