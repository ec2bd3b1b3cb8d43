"""The caches of the op path, in the style of ``functools.lru_cache``: the dispatcher's call cache (one entry
per op and argument key: a compiled plan, or a fallback with its reason) and the learnt local calls. Both
are least recently used and bounded, by default at 4096 entries each (``SBP_TORCH_CACHE_SIZE``)."""

from typing import NamedTuple

from .._dispatch import CALLS, CacheInfo
from .._frontend import LOCAL_CALLS


class Caches(NamedTuple):
    """``cache_info()``: the statistics of each cache."""

    calls: CacheInfo
    local_calls: CacheInfo


def cache_info() -> Caches:
    """Hits, misses, bound and size of the call cache and of the local-call cache."""
    return Caches(CALLS.info(), LOCAL_CALLS.info())


def cache_clear() -> None:
    """Empty both caches and reset their statistics (later calls decide and learn again)."""
    CALLS.clear()
    LOCAL_CALLS.clear()


def set_cache_size(maxsize: int) -> None:
    """Bound each cache to ``maxsize`` entries, dropping the least recently used ones beyond it."""
    CALLS.resize(maxsize)
    LOCAL_CALLS.resize(maxsize)
