"""LRU cache of whole search results: a repeated query on the same index version costs a dictionary lookup.

The query embedding cache (gare_serve/query_cache.py) skips the text encoder for a repeated query, but the ANN
and the psi rerank still run, and on a large index they are most of what is left (bench/results/serve_http.md).
A search is a pure function of (index version, checkpoint, text tower, rerank path, normalised text, options),
so this cache keeps the finished :class:`gare_search.search.QueryResult` under exactly that key and answers a
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
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from gare_search.search import QueryResult, SearchOptions

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
HIT_BYTES = 160  # one gare_search.search.Hit (a dataclass of five numbers), rounded up from tracemalloc's ~145
ENTRY_OVERHEAD_BYTES = 512  # the tuples, the key tuple and the OrderedDict node
# A rendered hit (gare_serve.schemas.Hit with its metadata dict): pydantic model + dict + str objects. Measured with
# tracemalloc (tests/service/test_result_cache.py holds this estimate above the measurement).
RENDERED_BYTES_PER_JSON_BYTE = 4
RENDERED_OVERHEAD_BYTES = 1024


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
        self._data: OrderedDict[Key, tuple[tuple[tuple[Any, ...], tuple[Any, ...]], int]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0 and self.max_bytes > 0

    @staticmethod
    def entry_bytes(key: Key, result: QueryResult, rendered: Sequence[Any] = ()) -> int:
        """Estimated bytes of one entry: the hits, the key text, a fixed overhead and the rendered hits
        (RENDERED_BYTES_PER_JSON_BYTE per byte of their JSON; tests hold the estimate above tracemalloc's)."""
        out = len(result.hits) * HIT_BYTES + len(str(key[4]).encode("utf-8")) + ENTRY_OVERHEAD_BYTES
        for h in rendered:
            out += RENDERED_BYTES_PER_JSON_BYTE * len(h.model_dump_json()) + RENDERED_OVERHEAD_BYTES
        return out

    def key(self, version: str, checkpoint: str, variant: str, rerank_impl: str, text: str, options: SearchOptions) -> Key:
        return (str(version), str(checkpoint), str(variant), str(rerank_impl), self.normalize(text), options)

    def lookup(self, key: Key) -> tuple[QueryResult, tuple[Any, ...]] | None:
        """(a copy of the cached result marked ``cached`` with zero stage timings, the rendered hits as they were
        put), or None. The rendered hits are shared, not copied: the caller must not change them."""
        if not self.enabled:
            return None
        with self._lock:
            got = self._data.get(key)
            if got is None:
                self.misses += 1
                self.metrics.lookups.labels("miss").inc()
                return None
            hits, rendered = got[0]
            self._data.move_to_end(key)
            self.hits += 1
        self.metrics.lookups.labels("hit").inc()
        return QueryResult(hits=[copy.copy(h) for h in hits], timings={}, cached=True), rendered

    def get(self, key: Key) -> QueryResult | None:
        """A copy of the cached result marked ``cached`` with zero stage timings, or None."""
        got = self.lookup(key)
        return None if got is None else got[0]

    def put(self, key: Key, result: QueryResult, rendered: Sequence[Any] = ()) -> None:
        """Keep `result` (its hits copied) and, optionally, the hits as the API renders them (immutable by
        contract: pydantic models with the metadata, so a repeat needs no metadata read)."""
        if not self.enabled:
            return
        value = (tuple(copy.copy(h) for h in result.hits), tuple(rendered))
        size = self.entry_bytes(key, result, rendered)
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
