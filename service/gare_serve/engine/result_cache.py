"""LRU cache of whole search results: a repeated query on the same index version costs a dictionary lookup.

The query embedding cache (gare_serve/engine/query_cache.py) skips the text encoder for a repeated query, but the ANN
and the psi rerank still run, and on a large index they are most of what is left. A search is a pure function of (index version, checkpoint, text tower, normalised text, options),
so this cache keeps the finished :class:`gare_search.search.QueryResult` under exactly that key and answers a
repeat without entering the micro-batch queue at all (so a popular query is not slowed by the misses queued
in front of it).

Key = (index version name, checkpoint sha256, encoder variant, normalised text, SearchOptions).
A reload switches to another version name, so old entries can never answer; :meth:`ResultCache.clear` drops
them at the switch. The text is normalised exactly as the embedding cache does (the tokenizer's own
``clean_fn``), so two texts share an entry only if they are the same tokens.

Bounded by entries and by bytes (:class:`gare_serve.lru.ByteLRU`): an entry is counted as its hits (HIT_BYTES
each, measured with tracemalloc: ~145 bytes per Hit) plus its key text and a fixed overhead, so a flood of
k = 1000 queries cannot grow a worker past ``max_bytes``. Thread-safe. Off when either bound is 0. The service
also keeps it off while the adaptive query bank records traffic (GARE_QUERY_BANK_SIZE > 0): a cached answer
would not reach the bank.

Metrics: ``gare_result_cache_lookups_total{result="hit"|"miss"}`` and ``gare_result_cache_entries`` (gauge,
livesum across workers).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from gare_search.search import QueryResult, SearchOptions
from gare_serve.lru import ByteLRU

__all__ = ["ResultCache", "ResultCacheMetrics"]


class ResultCacheMetrics:
    """The result cache's Prometheus series, on ``registry`` (a private one when None)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.lookups = Counter("gare_result_cache_lookups", "search result cache lookups by result", ["result"], registry=r)
        self.entries = Gauge("gare_result_cache_entries", "entries in the search result cache", registry=r,
                             multiprocess_mode="livesum")
        for res in ("hit", "miss"):
            self.lookups.labels(res)


Key = tuple[Hashable, ...]
TEXT = 3  # the normalised text's place in a key
HIT_BYTES = 160  # one gare_search.search.Hit (a dataclass of five numbers), rounded up from tracemalloc's ~145
ENTRY_OVERHEAD_BYTES = 512  # the tuples, the key tuple and the OrderedDict node
# A rendered hit (gare_serve.web.schemas.Hit with its metadata dict): pydantic model + dict + str objects. Measured with
# tracemalloc (tests/service/test_result_cache.py holds this estimate above the measurement).
RENDERED_BYTES_PER_JSON_BYTE = 4
RENDERED_OVERHEAD_BYTES = 1024


class ResultCache:
    """Thread-safe LRU of finished search results (see the module docstring for the key)."""

    def __init__(self, max_entries: int, max_bytes: int = 64 << 20, *, normalize: Callable[[str], str] = str,
                 metrics: ResultCacheMetrics | None = None) -> None:
        self._lru: ByteLRU[Key, tuple[tuple[Any, ...], tuple[Any, ...]]] = ByteLRU(max_entries, max_bytes)
        self.max_entries = self._lru.max_entries
        self.max_bytes = int(max_bytes)
        self.normalize = normalize
        self.metrics = metrics if metrics is not None else ResultCacheMetrics()

    @property
    def enabled(self) -> bool:
        return self._lru.enabled

    @staticmethod
    def entry_bytes(key: Key, result: QueryResult, rendered: Sequence[Any] = ()) -> int:
        """Estimated bytes of one entry: the hits, the key text, a fixed overhead and the rendered hits
        (RENDERED_BYTES_PER_JSON_BYTE per byte of their JSON; tests hold the estimate above tracemalloc's)."""
        out = len(result.hits) * HIT_BYTES + len(str(key[TEXT]).encode("utf-8")) + ENTRY_OVERHEAD_BYTES
        for h in rendered:
            out += RENDERED_BYTES_PER_JSON_BYTE * len(h.model_dump_json()) + RENDERED_OVERHEAD_BYTES
        return out

    def key(self, version: str, checkpoint: str, variant: str, text: str, options: SearchOptions) -> Key:
        return (str(version), str(checkpoint), str(variant), self.normalize(text), options)

    def lookup(self, key: Key) -> tuple[QueryResult, tuple[Any, ...]] | None:
        """(a copy of the cached result marked ``cached`` with zero stage timings, the rendered hits as they were
        put), or None. The rendered hits are shared, not copied: the caller must not change them."""
        if not self.enabled:
            return None
        got = self._lru.get(key)
        self.metrics.lookups.labels("hit" if got is not None else "miss").inc()
        if got is None:
            return None
        hits, rendered = got
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
        if self._lru.put(key, value, self.entry_bytes(key, result, rendered)) is None:
            return  # larger than the whole cache: never stored
        self.metrics.entries.set(len(self._lru))

    def clear(self) -> None:
        self._lru.clear()
        self.metrics.entries.set(0)

    def __len__(self) -> int:
        return len(self._lru)

    def keys(self) -> list[Key]:
        """Keys from least to most recently used (for tests and debugging)."""
        return self._lru.keys()

    def stats(self) -> dict[str, Any]:
        st = self._lru.stats()
        return {"entries": st.entries, "bytes": st.bytes, "hits": st.hits, "misses": st.misses}
