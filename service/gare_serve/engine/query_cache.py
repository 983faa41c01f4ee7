"""LRU cache of query embeddings: a repeated query skips the text encoder.

Key = (checkpoint sha256, encoder variant, normalised text):
- the checkpoint hash, because another checkpoint gives another embedding (an index reload that changes
  the checkpoint simply stops hitting the old entries, which age out);
- the encoder variant (``"fp32"``, ``"bf16"``, ``"int8"``, ``"fp16"`` ...), because a quantised or
  low-precision tower gives a slightly different t than fp32 and a switch must not serve stale vectors;
- the text as the tokenizer sees it (:func:`make_normalizer`).

Normalisation. The key must merge only texts that the tokenizer turns into the same tokens, or a hit
would return another query's embedding. open_clip's SimpleTokenizer cleans every text with ``clean_fn``
before BPE: ``ftfy.fix_text`` (which includes Unicode NFC, full-width -> ASCII and ligature fixes), HTML
unescape (twice), whitespace collapsed and stripped, then lower-cased (``clean="lower"``, the default for
CLIP models). We key on exactly that string, so "A  Dog\\t runs", "a dog runs" and "ＡＢＣ" / "abc" share an
entry. Plain Unicode NFKC is deliberately NOT applied on top: it folds "x²" into "x2" and "Ⅳ" into "iv",
which the tokenizer keeps apart (different tokens, different embeddings); see
tests/service/test_query_cache.py::test_key_never_merges_texts_with_different_tokens. For a tokenizer without
``clean_fn`` (case-sensitive HF tokenizers) the fallback is NFC + whitespace collapse, case kept.

Bounds (:class:`gare_serve.lru.ByteLRU`): at most ``max_entries`` entries AND at most ``max_bytes`` bytes (embedding bytes plus the key's
UTF-8 bytes and a fixed per-entry overhead estimate); the least recently used entries are evicted first.
``max_entries == 0`` or ``max_bytes == 0`` turns the cache off (every lookup is a miss that is not
counted, nothing is stored). All methods are thread-safe (one lock; the critical sections are dict
operations only, never the encoder).

Metrics (registered on the registry given, e.g. ``gare_serve.engine.prometheus.Metrics().registry``):
``gare_query_cache_lookups_total{result="hit"|"miss"}``, ``gare_query_cache_evictions_total{reason=
"entries"|"bytes"}``, ``gare_query_cache_entries`` and ``gare_query_cache_bytes`` (gauges, livesum across
workers in prometheus multiprocess mode).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge

from gare.text_clean import nfc_whitespace
from gare_serve.lru import ByteLRU, LRUStats

log = logging.getLogger(__name__)

# Per-entry bookkeeping beyond the vector and the key text (OrderedDict node, tuple, tensor header):
# an estimate, so that a flood of tiny entries still respects the byte bound.
ENTRY_OVERHEAD_BYTES = 256

__all__ = ["QueryCache", "QueryCacheMetrics", "make_normalizer", "default_normalize"]


# Unicode NFC, whitespace collapsed and stripped, case kept: the cleaning for a tokenizer without its own
default_normalize = nfc_whitespace


def make_normalizer(tokenizer: Any | None) -> Callable[[str], str]:
    """The text normaliser matching ``tokenizer``: its own ``clean_fn`` (open_clip) when it has one."""
    clean = getattr(tokenizer, "clean_fn", None)
    if callable(clean):
        return clean
    return default_normalize


class QueryCacheMetrics:
    """The cache's Prometheus series, on ``registry`` (a private one when None)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.registry = r
        self.lookups = Counter("gare_query_cache_lookups", "query embedding cache lookups by result", ["result"], registry=r)
        self.evictions = Counter(
            "gare_query_cache_evictions", "query embedding cache evictions by the bound that forced them", ["reason"], registry=r
        )
        self.entries = Gauge("gare_query_cache_entries", "entries in the query embedding cache", registry=r, multiprocess_mode="livesum")
        self.bytes = Gauge("gare_query_cache_bytes", "bytes held by the query embedding cache", registry=r, multiprocess_mode="livesum")
        # make the label sets visible (at 0) before the first lookup
        for res in ("hit", "miss"):
            self.lookups.labels(res)
        for reason in ("entries", "bytes"):
            self.evictions.labels(reason)


Key = tuple[str, str, str]


class QueryCache:
    """Thread-safe LRU of query embeddings, bounded by entries and bytes (a :class:`gare_serve.lru.ByteLRU`).

    Values are stored as detached float32 CPU tensors of shape (d,); :meth:`get` returns a copy (callers
    may move or modify it freely).
    """

    def __init__(
        self,
        max_entries: int,
        max_bytes: int,
        *,
        normalize: Callable[[str], str] = default_normalize,
        registry: CollectorRegistry | None = None,
        metrics: QueryCacheMetrics | None = None,
    ) -> None:
        self._lru: ByteLRU[Key, torch.Tensor] = ByteLRU(max_entries, max_bytes)
        self.max_entries = self._lru.max_entries
        self.max_bytes = int(max_bytes)
        self.normalize = normalize
        self.metrics = metrics if metrics is not None else QueryCacheMetrics(registry)

    @property
    def enabled(self) -> bool:
        return self._lru.enabled

    # ---------------------------------------------------------------- keys
    def key(self, text: str, checkpoint: str, variant: str = "") -> Key:
        return (str(checkpoint), str(variant), self.normalize(text))

    @staticmethod
    def entry_bytes(key: Key, value: torch.Tensor) -> int:
        return value.numel() * value.element_size() + sum(len(k.encode("utf-8")) for k in key) + ENTRY_OVERHEAD_BYTES

    # ---------------------------------------------------------------- lookups
    def get(self, text: str, checkpoint: str, variant: str = "") -> torch.Tensor | None:
        """The cached embedding (d,) float32 CPU (a copy), or None; a hit becomes the most recent entry."""
        if not self.enabled:
            return None
        hit = self._lru.get(self.key(text, checkpoint, variant))
        self.metrics.lookups.labels("hit" if hit is not None else "miss").inc()
        return None if hit is None else hit.clone()

    def put(self, text: str, checkpoint: str, embedding: torch.Tensor, variant: str = "") -> None:
        """Store embedding (d,) (any device/dtype; kept as float32 on the CPU) and evict down to the bounds."""
        if not self.enabled:
            return
        if embedding.ndim != 1:
            raise ValueError(f"put() takes one embedding of shape (d,), got shape {tuple(embedding.shape)}")
        k = self.key(text, checkpoint, variant)
        v = embedding.detach().to("cpu", torch.float32).clone()
        size = self.entry_bytes(k, v)
        evicted = self._lru.put(k, v, size)
        if evicted is None:
            log.debug("query cache: one entry (%d bytes) exceeds max_bytes=%d; not stored", size, self.max_bytes)
            return
        if evicted.entries:
            self.metrics.evictions.labels("entries").inc(evicted.entries)
        if evicted.bytes:
            self.metrics.evictions.labels("bytes").inc(evicted.bytes)
        st = self._lru.stats()
        self.metrics.entries.set(st.entries)
        self.metrics.bytes.set(st.bytes)

    def encode(
        self,
        texts: Sequence[str],
        checkpoint: str,
        encode_fn: Callable[[list[str]], torch.Tensor],
        variant: str = "",
    ) -> tuple[torch.Tensor, list[bool]]:
        """Embeddings (a, d) float32 for ``texts``, running ``encode_fn`` once on the distinct misses only.

        Returns (t on the device ``encode_fn`` returned, or CPU when everything hit; hit flags per text).
        Texts that normalise to the same key within one call are encoded once.
        """
        if not texts:
            raise ValueError("encode() needs at least one text")
        found: list[torch.Tensor | None] = [self.get(t, checkpoint, variant) for t in texts]
        hits = [f is not None for f in found]
        todo: dict[str, list[int]] = {}
        for i, f in enumerate(found):
            if f is None:
                todo.setdefault(self.normalize(texts[i]), []).append(i)
        device = torch.device("cpu")
        if todo:
            firsts = [texts[idx[0]] for idx in todo.values()]
            fresh = encode_fn(firsts)  # (m, d)
            if fresh.shape[0] != len(firsts):
                raise RuntimeError(f"encode_fn returned {fresh.shape[0]} rows for {len(firsts)} texts")
            device = fresh.device
            fresh_cpu = fresh.detach().to("cpu", torch.float32)
            for row, (text, idx) in enumerate(zip(firsts, todo.values(), strict=True)):
                self.put(text, checkpoint, fresh_cpu[row], variant)
                for i in idx:
                    found[i] = fresh_cpu[row]
        out = torch.stack([f for f in found if f is not None]).to(device)  # (a, d)
        return out, hits

    # ---------------------------------------------------------------- housekeeping
    def clear(self) -> None:
        self._lru.clear()
        self.metrics.entries.set(0)
        self.metrics.bytes.set(0)

    def stats(self) -> LRUStats:
        return self._lru.stats()

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def nbytes(self) -> int:
        return self._lru.nbytes

    def keys(self) -> list[Key]:
        """Keys from least to most recently used (for tests and debugging)."""
        return self._lru.keys()


def from_settings(settings: Any, tokenizer: Any | None = None, registry: CollectorRegistry | None = None) -> QueryCache:
    """The cache configured by ``settings.query_cache_entries`` / ``query_cache_bytes`` (0 = off)."""
    return QueryCache(
        settings.query_cache_entries,
        settings.query_cache_bytes,
        normalize=make_normalizer(tokenizer),
        registry=registry,
    )
