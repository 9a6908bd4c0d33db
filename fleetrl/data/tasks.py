"""Built-in synthetic tasks for tests and the quickstart: small enough for a random-init tiny model to learn
on 2 CPU cores in minutes, hard enough that a random policy scores below 20%.

Every prompt is a verl-schema row whose words are all in the tiny tokenizer's vocabulary
(fleetrl/models/tiny.py). `split=train|val` draws disjoint prompts: the noise words of a prompt are hashed to
a split, so validation measures generalisation to unseen prompts, not memorisation.
"""
from __future__ import annotations

import random
import zlib

from fleetrl.data.synthetic import register_synthetic

_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_OPS = {
    "copy": lambda d: d,
    "next": lambda d: (d + 1) % 10,
}


def _split_of(words: list[str]) -> str:
    # 1 in 5 noise patterns goes to validation.
    return "val" if zlib.crc32(" ".join(words).encode()) % 5 == 0 else "train"


def _digit_rows(op: str, *, n: int, split: str, seed: int, noise: int) -> list[dict]:
    if op not in _OPS:
        raise ValueError(f"unknown op {op!r}; choose from {sorted(_OPS)}")
    if split not in ("train", "val"):
        raise ValueError(f"parameter 'split' must be train or val, got {split!r}")
    rng = random.Random(f"{seed}-{op}-{split}")
    rows = []
    while len(rows) < n:
        words = [rng.choice(_LETTERS) for _ in range(noise)]
        if noise and _split_of(words) != split:
            continue
        digit = rng.randrange(10)
        content = " ".join([op, *words, str(digit), "="])
        rows.append({
            "data_source": f"synthetic/{op}",
            "prompt": [{"role": "user", "content": content}],
            "ability": "digits",
            "reward_model": {"ground_truth": str(_OPS[op](digit)), "style": "rule"},
            "extra_info": {"index": len(rows), "split": split},
        })
    return rows


@register_synthetic("copy")
def copy_task(n: int = 512, split: str = "train", seed: int = 0, noise: int = 2) -> list[dict]:
    """`copy a b 7 =` -> `7`: answer with the digit before `=` (noise letters in between vary)."""
    return _digit_rows("copy", n=n, split=split, seed=seed, noise=noise)


@register_synthetic("next")
def next_task(n: int = 512, split: str = "train", seed: int = 0, noise: int = 2) -> list[dict]:
    """`next a b 7 =` -> `8`: answer with the digit after the given one (mod 10)."""
    return _digit_rows("next", n=n, split=split, seed=seed, noise=noise)


_WORDS = ("time year people way day man thing woman life child world school state family student group country "
          "problem hand part place case week company system program question work government number night point "
          "home water room mother area money story fact month lot right study book eye job word business issue "
          "side kind head house service friend father power hour game line end member law car city community name").split()


@register_synthetic("lorem")
def lorem_task(n: int = 512, words: int = 120, seed: int = 0, split: str = "train") -> list[dict]:
    """Prompts of `words` random common words (about one token each with BPE vocabularies), for throughput
    benchmarks; the ground truth is a random word (a reward function decides what counts)."""
    rng = random.Random(f"{seed}-lorem-{split}")
    return [{"data_source": "synthetic/lorem",
             "prompt": [{"role": "user", "content": " ".join(rng.choice(_WORDS) for _ in range(words))}],
             "reward_model": {"ground_truth": rng.choice(_WORDS)}, "extra_info": {"index": i}}
            for i in range(n)]


@register_synthetic("lookup")
def lookup_task(n: int = 512, keys: int = 26, split: str = "train", seed: int = 0) -> list[dict]:
    """`? q =` -> `7`, where 7 is the value stored under key `q` in this row's own random table
    (`extra_info.lookup`, `keys` letters -> digits). The value appears nowhere in the prompt, so only the
    `lookup` environment (fleetrl.envs.tool_env.lookup_env) can supply it: the model calls `? q`, reads the
    tool's `7`, and answers `7`. Every word is in the tiny vocabulary."""
    if not 1 <= keys <= len(_LETTERS):
        raise ValueError(f"parameter 'keys' must be in 1..{len(_LETTERS)}, got {keys}")
    if split not in ("train", "val"):
        raise ValueError(f"parameter 'split' must be train or val, got {split!r}")
    rng = random.Random(f"{seed}-lookup-{split}")
    rows = []
    while len(rows) < n:
        table = {k: str(rng.randrange(10)) for k in rng.sample(_LETTERS, keys)}
        key = rng.choice(sorted(table))
        if _split_of([key, *(k + v for k, v in sorted(table.items()))]) != split:
            continue
        rows.append({
            "data_source": "synthetic/lookup",
            "prompt": [{"role": "user", "content": f"? {key} ="}],
            "ability": "tools",
            "reward_model": {"ground_truth": table[key], "style": "rule"},
            "extra_info": {"index": len(rows), "split": split, "lookup": table, "key": key},
        })
    return rows
