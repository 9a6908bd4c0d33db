"""FrozenDict: the read-only mapping every config and Plan field uses, so nothing can change a setting after the
workers were built from it (`cfg.cluster.env["X"] = ...` raises TypeError).

Not `types.MappingProxyType`: configs travel to Ray workers by pickle, and a mappingproxy does not pickle.
"""
from __future__ import annotations

from typing import Any, Iterator, Mapping, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class FrozenDict(Mapping[K, V]):
    __slots__ = ("_data",)

    def __init__(self, data: Mapping[K, V] | None = None) -> None:
        object.__setattr__(self, "_data", dict(data or {}))

    def __getitem__(self, key: K) -> V:
        return self._data[key]

    def __iter__(self) -> Iterator[K]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __setattr__(self, name: str, value: Any) -> None:
        raise TypeError(f"{type(self).__name__} is read-only")

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._data.items(), key=repr)))

    def __repr__(self) -> str:
        return repr(self._data)

    def __reduce__(self):
        return (FrozenDict, (self._data,))


def deep_freeze(value: Any) -> Any:
    """dicts -> FrozenDict and lists -> tuples, all the way down (for `Any`-typed fields such as data mixtures)."""
    if isinstance(value, Mapping):
        return FrozenDict({k: deep_freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(deep_freeze(v) for v in value)
    return value
