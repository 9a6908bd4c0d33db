"""Benchmark reward: a deterministic pseudo-random score per response, so advantages are non-zero and the
update does real work without a meaningful task."""
import zlib


def score(response: str, ground_truth, extra_info) -> float:
    return (zlib.crc32(response.encode()) % 1000) / 1000.0
