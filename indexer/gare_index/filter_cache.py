"""Filter results kept per index version: the rows a filter passes, evaluated once and reused while the version is
served (a version never changes once written, so an entry never goes stale).

Users repeat filters (one channel, one licence, "after March"); evaluating one is a pass over every row of each
column it reads, which at 1M rows costs as much as the filtered search itself. Lucene's query cache keeps filter
bitsets per segment for the same reason. An entry holds what each plan of :mod:`gare_search.filtered` reads:

* ``mask`` (n,) bool in ids.npy row order (read-only: a caller that edits it copies it first);
* ``bits``: the passing ids as a packed bitmap, bit i = id i, the layout of faiss's ``IDSelectorBitmap``
  (the filter inside the ANN);
* ``rows``: the passing rows (passing,) int64, made on first use (the exact plan).

Entries are evicted least recently used first once their bytes pass ``max_bytes``; one entry larger than that is
returned but not kept.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

FILTER_CACHE_BYTES = 64 * 1024 * 1024  # ~50 distinct filters over a 1M-row version (1.1 MB each + their rows)


@dataclass
class FilterRows:
    """The rows one filter passes in one version (see the module docstring)."""

    mask: np.ndarray  # (n,) bool, row order, read-only
    bits: np.ndarray  # (ceil((max id + 1) / 8),) uint8, little-endian bit order: bit i = id i
    passing: int
    _rows: np.ndarray | None = field(default=None, repr=False)

    @property
    def rows(self) -> np.ndarray:
        """The passing rows (passing,) int64, ascending."""
        if self._rows is None:
            r = np.flatnonzero(self.mask)
            r.setflags(write=False)
            self._rows = r
        return self._rows

    @property
    def nbytes(self) -> int:
        return int(self.mask.nbytes + self.bits.nbytes + 8 * self.passing)  # the rows counted once made or not


def id_bitmap(mask: np.ndarray, ids: np.ndarray, *, ids_are_rows: bool) -> np.ndarray:
    """The ids of the rows `mask` (n,) bool passes, as a packed bitmap (faiss's IDSelectorBitmap layout).
    `ids` (n,) int64 are the version's ids in row order; `ids_are_rows`: ids == arange(n), so the mask already is
    the bitmap's bit array (what a version without removals has)."""
    m = np.asarray(mask, dtype=bool)
    if ids_are_rows:
        return np.packbits(m, bitorder="little")
    if not ids.size:
        return np.zeros(0, np.uint8)
    allowed = np.zeros(int(ids.max()) + 1, dtype=bool)
    allowed[ids[m]] = True
    return np.packbits(allowed, bitorder="little")


class FilterCache:
    """Filter text (:attr:`gare_index.filters.Filter.text`, canonical) -> :class:`FilterRows`, LRU by bytes.
    Thread-safe; two threads missing the same filter at once may both evaluate it (the result is the same)."""

    def __init__(self, max_bytes: int = FILTER_CACHE_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self._entries: OrderedDict[str, FilterRows] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def get(self, key: str, build: Callable[[], FilterRows]) -> tuple[FilterRows, bool]:
        """(the entry for `key`, whether it was cached); `build()` makes a missing one (outside the lock: it
        reads columns and may take milliseconds)."""
        with self._lock:
            got = self._entries.get(key)
            if got is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return got, True
            self.misses += 1
        made = build()
        size = made.nbytes
        if size > self.max_bytes:
            return made, False
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            self._entries[key] = made
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= dropped.nbytes
        return made, False
