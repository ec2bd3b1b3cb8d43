"""A bounded least-recently-used cache with the interface of ``functools.lru_cache``'s statistics.

The dispatcher keeps one of these for its call plans, the frontend one for its learnt local calls. A long
run with changing shapes (a new sequence length every step) would otherwise grow them without limit.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import NamedTuple

DEFAULT_SIZE = int(os.environ.get("SBP_TORCH_CACHE_SIZE", "4096"))


class CacheInfo(NamedTuple):
    """As ``functools.lru_cache``'s ``cache_info()``: hits, misses, the bound, the entries held."""

    hits: int
    misses: int
    maxsize: int
    currsize: int


class LruCache:
    """Up to ``maxsize`` entries; a hit makes its entry the most recent, an insertion past the bound drops
    the least recent. Safe to share between threads: each step is one operation on an ``OrderedDict``,
    and a step that finds its entry gone (dropped by another thread meanwhile) is taken as a miss."""

    def __init__(self, maxsize: int = DEFAULT_SIZE):
        self._entries: OrderedDict = OrderedDict()
        self.maxsize = maxsize
        self.hits = self.misses = 0

    def get(self, key):
        """The entry of ``key`` (counted as a hit), or None (a miss); ``key`` must be hashable."""
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        try:
            self._entries.move_to_end(key)
        except KeyError:
            pass
        return entry

    def peek(self, key):
        """The entry of ``key`` or None, counting nothing and changing no order."""
        return self._entries.get(key)

    def put(self, key, entry) -> None:
        self._entries[key] = entry
        while len(self._entries) > self.maxsize:
            try:
                self._entries.popitem(last=False)
            except KeyError:
                break

    def entries(self) -> list:
        """The entries, least recently used first."""
        return list(self._entries.values())

    def pop(self, key) -> None:
        self._entries.pop(key, None)

    def resize(self, maxsize: int) -> None:
        """Bound the cache to ``maxsize`` entries (at least 1), dropping the least recent ones beyond it."""
        if maxsize < 1:
            raise ValueError(f"a cache needs room for at least one entry, got maxsize={maxsize}")
        self.maxsize = maxsize
        while len(self._entries) > maxsize:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()
        self.hits = self.misses = 0

    def info(self) -> CacheInfo:
        return CacheInfo(self.hits, self.misses, self.maxsize, len(self._entries))

    def __len__(self) -> int:
        return len(self._entries)
