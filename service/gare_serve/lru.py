"""The service's one bounded LRU: a thread-safe map bounded by entries and by bytes, least recently used out first.

The query embedding cache (``gare_serve.engine.query_cache``), the search result cache (``gare_serve.engine.result_cache``) and
the thumbnail cache (``gare_serve.media.thumbnails``) all keep their entries here; each computes the size of its own
entries (an estimate of what the entry holds in memory) and keeps its own Prometheus series. One lock guards the
map; its critical sections are dictionary operations only, so no caller's work (an encoder, a decoder) runs under it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

__all__ = ["ByteLRU", "Evicted", "LRUStats"]


@dataclass(frozen=True)
class Evicted:
    """Entries one put() evicted, by the bound that forced them out."""

    entries: int = 0  # over max_entries
    bytes: int = 0  # over max_bytes


@dataclass(frozen=True)
class LRUStats:
    hits: int
    misses: int
    evictions: int
    entries: int
    bytes: int

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0


class ByteLRU(Generic[K, V]):
    """At most ``max_entries`` entries AND at most ``max_bytes`` bytes (None: no byte bound); 0 turns it off.

    Off, every lookup misses without being counted and nothing is stored. An entry larger than ``max_bytes`` on
    its own is never stored (it would evict everything and still not fit).
    """

    def __init__(self, max_entries: int, max_bytes: int | None = None) -> None:
        if max_entries < 0:
            raise ValueError(f"max_entries must be >= 0 (0 = off), got {max_entries}")
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 (0 = off), got {max_bytes}")
        self.max_entries = int(max_entries)
        self.max_bytes = None if max_bytes is None else int(max_bytes)
        self._data: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._hits = self._misses = self._evictions = 0

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0 and (self.max_bytes is None or self.max_bytes > 0)

    def get(self, key: K) -> V | None:
        """The value (the stored object itself, not a copy), or None; a hit becomes the most recent entry."""
        if not self.enabled:
            return None
        with self._lock:
            got = self._data.get(key)
            if got is None:
                self._misses += 1
                return None
            self._data.move_to_end(key)
            self._hits += 1
            return got[0]

    def fits(self, size: int) -> bool:
        """Whether an entry of ``size`` bytes can be stored at all."""
        return self.enabled and (self.max_bytes is None or size <= self.max_bytes)

    def put(self, key: K, value: V, size: int = 0) -> Evicted | None:
        """Store ``value`` (``size`` bytes) as the most recent entry and evict down to the bounds; None when it
        was not stored (off, or larger than the whole cache)."""
        if not self.fits(size):
            return None
        ev_entries = ev_bytes = 0
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            self._data[key] = (value, size)
            self._bytes += size
            while len(self._data) > self.max_entries:
                _, (_, s) = self._data.popitem(last=False)
                self._bytes -= s
                ev_entries += 1
            while self.max_bytes is not None and self._bytes > self.max_bytes:
                _, (_, s) = self._data.popitem(last=False)
                self._bytes -= s
                ev_bytes += 1
            self._evictions += ev_entries + ev_bytes
        return Evicted(ev_entries, ev_bytes)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._bytes = 0

    def stats(self) -> LRUStats:
        with self._lock:
            return LRUStats(self._hits, self._misses, self._evictions, len(self._data), self._bytes)

    def __len__(self) -> int:
        with self._lock:
            return len(self._data)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._bytes

    def keys(self) -> list[K]:
        """Keys from least to most recently used (for tests and debugging)."""
        with self._lock:
            return list(self._data)
