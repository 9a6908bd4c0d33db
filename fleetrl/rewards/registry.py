"""Scorer registry, `path/to/file.py:fn` loading, and routing each sample to a scorer by its data_source."""
from __future__ import annotations

import os
from types import ModuleType
from typing import Callable, Iterable

from fleetrl.rewards.code import code_tests
from fleetrl.rewards.errors import RewardError
from fleetrl.rewards.scorers import Scorer, exact_match, format_match, gsm8k, math_answer, prefix_match
from fleetrl.userfile import UserFileImportError, load_user_file

SCORERS: dict[str, Scorer] = {
    "exact_match": exact_match,
    "prefix_match": prefix_match,
    "gsm8k": gsm8k,
    "math": math_answer,
    "format": format_match,
    "code": code_tests,
}

# Data sources with no explicit route fall back to a builtin when their name contains one of these
# (checked in order: "gsm8k" before "math" because e.g. "gsm8k_math_mix" is GSM8K-formatted).
FAMILY_DEFAULTS: tuple[tuple[str, str], ...] = (("gsm8k", "gsm8k"), ("math", "math"))

_SPEC_HELP = (f"a scorer is one of the builtins {sorted(SCORERS)} or 'path/to/file.py:function' "
              "(a function (response, ground_truth, extra_info) -> float)")



def canonical_spec(spec: str) -> str:
    """The spec in a form any process resolves the same way: builtin names as is, file paths made absolute."""
    if spec in SCORERS or ":" not in spec:
        return spec
    path, _, fn = spec.rpartition(":")
    return f"{os.path.abspath(path)}:{fn}"


def resolve_scorer(spec: str) -> Scorer:
    """A builtin name (see SCORERS) or 'path/to/file.py:fn' -> the scorer; RewardError naming the spec if bad."""
    if spec in SCORERS:
        return SCORERS[spec]
    path, sep, name = spec.rpartition(":")
    if not sep or not path.endswith(".py") or not name:
        raise RewardError(f"unknown reward scorer {spec!r}; {_SPEC_HELP}")
    module = _load_file(spec, path)
    if not hasattr(module, name):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise RewardError(f"reward scorer {spec!r}: {path} has no attribute {name!r}; callables found there: "
                          f"{found}")
    fn = getattr(module, name)
    if not callable(fn):
        raise RewardError(f"reward scorer {spec!r}: {name!r} in {path} is a {type(fn).__name__}, not a function")
    return fn


def _load_file(spec: str, path: str) -> ModuleType:
    try:
        return load_user_file(path, "fleetrl_user_reward_")
    except FileNotFoundError:
        raise RewardError(f"reward scorer {spec!r}: file {os.path.abspath(path)} does not exist; fix the path "
                          f"(relative paths are resolved from {os.getcwd()})") from None
    except UserFileImportError as e:
        raise RewardError(f"reward scorer {spec!r}: {e}") from e.cause


class RewardRouter:
    """Picks the scorer for a sample from its data_source.

    Order: an exact key of `mapping`; else the longest key that is a prefix of the data_source (a trailing
    '*' on a key is allowed and ignored, e.g. "openai/*"); else a builtin by family (name contains "gsm8k" ->
    gsm8k, "math" -> math); else `default`. Every spec is resolved at construction, so a bad spec fails
    before training, and `check_sources` lets the trainer reject unroutable data sources up front too.
    """

    def __init__(self, mapping: dict[str, str], *, default: str | None = None) -> None:
        self.mapping = {k: canonical_spec(v) for k, v in mapping.items()}
        self.default = canonical_spec(default) if default is not None else None
        for key, spec in self.mapping.items():
            _resolve_for(spec, f"rewards.sources.{key}")
        if self.default is not None:
            _resolve_for(self.default, "rewards.default")
        self._cache: dict[str, str] = {}

    def spec_for(self, data_source: str) -> str:
        """The canonical scorer spec for `data_source`; RewardError if none applies."""
        if data_source not in self._cache:
            spec = self._route(data_source)
            if spec is None:
                raise self._unknown([data_source])
            self._cache[data_source] = spec
        return self._cache[data_source]

    def scorer_for(self, data_source: str) -> Callable:
        return resolve_scorer(self.spec_for(data_source))

    def check_sources(self, sources: Iterable[str]) -> None:
        """Raises one RewardError listing every data source no scorer applies to (call before training)."""
        unknown = sorted({s for s in sources if self._route(s) is None})
        if unknown:
            raise self._unknown(unknown)

    def _route(self, data_source: str) -> str | None:
        if data_source in self.mapping:
            return self.mapping[data_source]
        prefixes = [k for k in self.mapping if data_source.startswith(k.rstrip("*"))]
        if prefixes:
            return self.mapping[max(prefixes, key=lambda k: len(k.rstrip("*")))]
        lowered = data_source.lower()
        for family, builtin in FAMILY_DEFAULTS:
            if family in lowered:
                return builtin
        return self.default

    def _unknown(self, sources: list[str]) -> RewardError:
        return RewardError(
            f"no reward scorer for data_source {', '.join(map(repr, sources))}; routed sources are "
            f"{sorted(self.mapping) or 'none'} (plus any name containing 'gsm8k' or 'math'). Add "
            f"`rewards.sources.<name>: <scorer>` for each, or set `rewards.default`; {_SPEC_HELP}")


def _resolve_for(spec: str, setting: str) -> None:
    try:
        resolve_scorer(spec)
    except RewardError as exc:
        raise RewardError(f"{setting}: {exc}") from exc
