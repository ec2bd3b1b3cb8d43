"""A bounded least-recently-used cache with ``functools.lru_cache``'s statistics, for the dispatcher's call plans and
the frontend's learnt local calls, which a new sequence length every step would otherwise grow without limit.

A hit is one dictionary lookup and a stamp from a counter (reordering an ordered dictionary on a hit hashes the key
again, doubling a hit's cost). An insertion past the bound drops the least recently stamped eighth of the entries at
once, so the cache never exceeds its bound and sorts once per many insertions."""

import itertools
import os
import threading
from typing import NamedTuple

DEFAULT_SIZE = int(os.environ.get("SBP_TORCH_CACHE_SIZE", "4096"))


class CacheInfo(NamedTuple):
    """As ``functools.lru_cache``'s ``cache_info()``: hits, misses, the bound, the entries held."""

    hits: int
    misses: int
    maxsize: int
    currsize: int


class LruCache:
    """Up to ``maxsize`` entries; past the bound, the least recently used go first. Safe to share between
    threads: a lookup or an insertion is one operation on a dictionary, and eviction holds a lock."""

    def __init__(self, maxsize: int = DEFAULT_SIZE):
        # (never rebound: the dispatcher's C hit path holds both, and reads and stamps entries as ``get`` does)
        self._entries: dict = {}  # key -> [value, stamp of its last use]
        self._clock = itertools.count()  # stamps: one per hit and one per insertion
        self._lock = threading.Lock()
        self.maxsize = maxsize
        self._inserted = self._misses = self._infos = self._first_stamp = 0

    def get(self, key):
        """The entry of ``key`` (counted as a hit), or None (a miss); ``key`` must be hashable."""
        slot = self._entries.get(key)
        if slot is None:
            self._misses += 1
            return None
        slot[1] = next(self._clock)
        return slot[0]

    def peek(self, key):
        """The entry of ``key`` or None, counting nothing."""
        slot = self._entries.get(key)
        return None if slot is None else slot[0]

    def put(self, key, entry) -> None:
        self._entries[key] = [entry, next(self._clock)]
        self._inserted += 1
        if len(self._entries) > self.maxsize:
            self._evict(self.maxsize - self.maxsize // 8)

    def _evict(self, keep: int) -> None:
        """Drop all but the ``keep`` most recently used entries."""
        with self._lock:
            by_age = sorted(self._entries.items(), key=lambda item: item[1][1])
            for key, _ in by_age[: max(len(by_age) - keep, 0)]:
                self._entries.pop(key, None)

    def pop(self, key) -> None:
        self._entries.pop(key, None)

    def entries(self) -> list:
        """The entries, least recently used first."""
        return [slot[0] for slot in sorted(self._entries.values(), key=lambda slot: slot[1])]

    def resize(self, maxsize: int) -> None:
        """Bound the cache to ``maxsize`` entries (at least 1), dropping the least recent ones beyond it."""
        if maxsize < 1:
            raise ValueError(f"a cache needs room for at least one entry, got maxsize={maxsize}")
        self.maxsize = maxsize
        if len(self._entries) > maxsize:
            self._evict(maxsize)

    def clear(self) -> None:
        self._entries.clear()
        self._first_stamp = next(self._clock) + 1
        self._inserted = self._misses = self._infos = 0

    def info(self) -> CacheInfo:
        # Stamps since the last clear went to hits, insertions and earlier calls of this method.
        hits = next(self._clock) - self._first_stamp - self._inserted - self._infos
        self._infos += 1
        return CacheInfo(hits, self._misses, self.maxsize, len(self._entries))

    def __len__(self) -> int:
        return len(self._entries)
