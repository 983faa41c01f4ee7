"""LRU cache of whole search results: a repeated query on the same index version costs a dictionary lookup.

The query embedding cache (service/query_cache.py) skips the text encoder for a repeated query, but the ANN
and the psi rerank still run, and on a large index they are most of what is left (bench/results/serve_http.md).
A search is a pure function of (index version, checkpoint, text tower, rerank path, normalised text, options),
so this cache keeps the finished :class:`indexer.search.QueryResult` under exactly that key and answers a
repeat without entering the micro-batch queue at all (so a popular query is not slowed by the misses queued
in front of it).

Key = (index version name, checkpoint sha256, encoder variant, rerank path, normalised text, SearchOptions).
A reload switches to another version name, so old entries can never answer; :meth:`ResultCache.clear` drops
them at the switch. The text is normalised exactly as the embedding cache does (the tokenizer's own
``clean_fn``), so two texts share an entry only if they are the same tokens.

Bounded by entries and by bytes (LRU): an entry is counted as its hits (HIT_BYTES each, measured with
tracemalloc: ~145 bytes per Hit) plus its key text and a fixed overhead, so a flood of k = 1000 queries
cannot grow a worker past ``max_bytes``. Thread-safe. Off when either bound is 0. The service also keeps it off while the adaptive query bank records traffic
(GARE_QUERY_BANK_SIZE > 0): a cached answer would not reach the bank.

Metrics: ``gare_result_cache_lookups_total{result="hit"|"miss"}`` and ``gare_result_cache_entries`` (gauge,
livesum across workers).
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from indexer.search import QueryResult, SearchOptions

__all__ = ["ResultCache", "ResultCacheMetrics"]


class ResultCacheMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.lookups = Counter("gare_result_cache_lookups", "search result cache lookups by result", ["result"], registry=r)
        self.entries = Gauge("gare_result_cache_entries", "entries in the search result cache", registry=r,
                             multiprocess_mode="livesum")
        for res in ("hit", "miss"):
            self.lookups.labels(res)


Key = tuple[Hashable, ...]
HIT_BYTES = 160  # one indexer.search.Hit (a dataclass of five numbers), rounded up from tracemalloc's ~145
ENTRY_OVERHEAD_BYTES = 512  # the QueryResult, its list, the key tuple and the OrderedDict node


class ResultCache:
    """Thread-safe LRU of finished search results (see the module docstring for the key)."""

    def __init__(self, max_entries: int, max_bytes: int = 64 << 20, *, normalize: Callable[[str], str] = str,
                 metrics: ResultCacheMetrics | None = None) -> None:
        if max_entries < 0:
            raise ValueError(f"max_entries must be >= 0 (0 = off), got {max_entries}")
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 (0 = off), got {max_bytes}")
        self.max_entries = int(max_entries)
        self.max_bytes = int(max_bytes)
        self._bytes = 0
        self.normalize = normalize
        self.metrics = metrics if metrics is not None else ResultCacheMetrics()
        self._data: OrderedDict[Key, tuple[QueryResult, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0 and self.max_bytes > 0

    @staticmethod
    def entry_bytes(key: Key, result: QueryResult) -> int:
        return len(result.hits) * HIT_BYTES + len(str(key[4]).encode("utf-8")) + ENTRY_OVERHEAD_BYTES

    def key(self, version: str, checkpoint: str, variant: str, rerank_impl: str, text: str, options: SearchOptions) -> Key:
        return (str(version), str(checkpoint), str(variant), str(rerank_impl), self.normalize(text), options)

    def get(self, key: Key) -> QueryResult | None:
        """A copy of the cached result marked ``cached`` with zero stage timings, or None."""
        if not self.enabled:
            return None
        with self._lock:
            got = self._data.get(key)
            if got is None:
                self.misses += 1
                self.metrics.lookups.labels("miss").inc()
                return None
            res = got[0]
            self._data.move_to_end(key)
            self.hits += 1
        self.metrics.lookups.labels("hit").inc()
        return QueryResult(hits=copy.deepcopy(res.hits), timings={}, cached=True)

    def put(self, key: Key, result: QueryResult) -> None:
        if not self.enabled:
            return
        value = QueryResult(hits=copy.deepcopy(result.hits), timings={}, cached=False)
        size = self.entry_bytes(key, value)
        if size > self.max_bytes:
            return  # larger than the whole cache: never stored
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            self._data[key] = (value, size)
            self._bytes += size
            while len(self._data) > self.max_entries or self._bytes > self.max_bytes:
                _, (_, sz) = self._data.popitem(last=False)
                self._bytes -= sz
            n = len(self._data)
        self.metrics.entries.set(n)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._bytes = 0
        self.metrics.entries.set(0)

    def __len__(self) -> int:
        return len(self._data)

    def stats(self) -> dict[str, Any]:
        return {"entries": len(self._data), "bytes": self._bytes, "hits": self.hits, "misses": self.misses}
