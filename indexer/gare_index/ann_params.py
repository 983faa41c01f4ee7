"""The ANN index types and their parameters (:class:`AnnParams`), and the defaults chosen from the gallery size.


Stage one of the two-stage search (SPEC section 4): the index holds the unit dual-tower video vectors and
returns the top-K videos by ``cos(t, v̄_j)``.  Four index types:

``flat``   exact brute force (``IndexIDMap2(IndexFlatIP)``); the reference, and the default below 50k items.
``ivf``    ``IndexIVFFlat`` (inner product) with ``nlist`` k-means cells, ``nprobe`` of them scanned per query;
           exact scores inside the scanned cells; supports removal.  Default from 50k to 5M items.
``hnsw``   ``IndexIDMap2(IndexHNSWFlat)`` graph index (``hnsw_m`` links, ``ef_search`` / ``ef_construction``);
           fast and accurate, but faiss cannot delete from an HNSW graph, so :meth:`AnnIndex.remove_ids`
           rebuilds it from the vectors it stores (O(n log n)); never chosen automatically for that reason.
``ivfpq``  ``IndexIVFPQ`` (``pq_m`` sub-quantisers of 8 bits): compressed codes for very large galleries
           (default from 5M items, where float vectors stop fitting comfortably in RAM).  PQ scores are
           approximate, so :class:`AnnIndex` searches ``k * rescore`` candidates and re-scores them exactly
           against the stored float vectors (``vectors``, a memmap is fine) before keeping the top k.

IVF variants (``AnnParams``): ``coarse`` picks the quantiser ("flat", "hnsw", or "auto" = an HNSW graph from
``COARSE_HNSW_MIN`` cells, where a flat quantiser's nlist * d flops per query start to dominate);
``fastscan=True`` makes ``ivfpq`` a 4-bit fast-scan PQ (``IndexIVFPQFastScan``, SIMD table lookups), still
re-scored exactly; ``train_per_cell`` bounds the k-means sample (rows per cell, default 64).
``AnnParams.from_index`` recovers all three from a saved index ("auto" comes back resolved).  Which type and
which query-time knobs meet a recall target: ``gare_build.tuning.recall``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import faiss
import numpy as np

__all__ = ["INDEX_TYPES", "FLAT_MAX", "IVFPQ_MIN", "COARSE_HNSW_MIN", "coarse_kind", "choose_index_type", "default_nlist",
           "default_nprobe", "default_pq_m", "AnnParams", "as_f32", "inner_index", "apply_search_params", "is_gpu", "cpu_of"]

INDEX_TYPES = ("flat", "ivf", "hnsw", "ivfpq")

# choose_index_type thresholds: exact search is cheap enough (and exact) below FLAT_MAX items; IVF-Flat
# (exact scores in the probed cells, cheap to build, supports removal for incremental updates) up to
# IVFPQ_MIN; compressed IVF-PQ with exact re-scoring beyond (at d = 512 float32, 5M vectors are 10 GB).
FLAT_MAX = 50_000
IVFPQ_MIN = 5_000_000
COARSE_HNSW_MIN = 16_384  # IVF cells from which the coarse quantiser is an HNSW graph (coarse="auto")


def choose_index_type(n: int) -> str:
    """``flat`` for n < 50,000; ``ivf`` for 50,000 <= n < 5,000,000; ``ivfpq`` from 5,000,000.

    HNSW is offered explicitly (it is accurate and fast, but cannot delete, which the incremental
    indexer needs), never chosen automatically.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if n < FLAT_MAX:
        return "flat"
    if n < IVFPQ_MIN:
        return "ivf"
    return "ivfpq"


def default_nlist(n: int) -> int:
    """~4 sqrt(n) cells, clipped to [1, n // 39] (faiss wants >= 39 training points per centroid)."""
    return int(max(1, min(round(4 * math.sqrt(max(n, 1))), n // 39)))


def default_nprobe(nlist: int) -> int:
    """2 sqrt(nlist), at least 16, at most nlist (about 10% of the cells at nlist = 500, 3% at 4,000)."""
    return int(min(nlist, max(16, round(2 * math.sqrt(nlist)))))


def default_pq_m(d: int) -> int:
    """Largest divisor of d that is <= d // 4 (4 dimensions per 8-bit sub-quantiser, 16x compression)."""
    target = max(1, d // 4)
    for m in range(target, 0, -1):
        if d % m == 0:
            return m
    return 1


@dataclass
class AnnParams:
    index_type: str
    nlist: int | None = None  # ivf / ivfpq cells (None: default_nlist(n))
    nprobe: int | None = None  # ivf / ivfpq cells scanned per query (None: default_nprobe(nlist))
    hnsw_m: int = 32
    ef_search: int = 128
    ef_construction: int = 200
    pq_m: int | None = None  # ivfpq sub-quantisers (None: default_pq_m(d)); must divide d
    rescore: int = 4  # ivfpq: shortlist k * rescore candidates, re-scored exactly
    coarse: str = "auto"  # ivf / ivfpq quantiser: "flat", "hnsw", or "auto" (hnsw from COARSE_HNSW_MIN cells)
    fastscan: bool = False  # ivfpq: 4-bit fast-scan PQ codes (SIMD table lookups: faster scans) instead of 8-bit
    train_per_cell: int = 64  # ivf / ivfpq: k-means training rows per cell (>= 39; fewer = faster training)

    def __post_init__(self) -> None:
        if self.index_type not in INDEX_TYPES:
            raise ValueError(f"index_type must be one of {INDEX_TYPES}, got {self.index_type!r}")
        for name in ("nlist", "nprobe", "pq_m"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if self.coarse not in ("auto", "flat", "hnsw"):
            raise ValueError(f"coarse must be auto, flat or hnsw, got {self.coarse!r}")
        if self.train_per_cell < 1:
            raise ValueError(f"train_per_cell must be >= 1, got {self.train_per_cell}")
        if self.hnsw_m < 2 or self.ef_search < 1 or self.ef_construction < 1 or self.rescore < 1:
            raise ValueError(
                "hnsw_m >= 2, ef_search >= 1, ef_construction >= 1 and rescore >= 1 are required"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AnnParams:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def from_index(cls, index: faiss.Index) -> AnnParams:
        """Recover the parameters of an index built by :func:`build_index` (e.g. after read_index)."""
        index = cpu_of(index)
        outer = faiss.downcast_index(index)
        inner = faiss.downcast_index(outer.index) if isinstance(outer, faiss.IndexIDMap) else outer
        if isinstance(inner, faiss.IndexIVF):
            coarse = "hnsw" if isinstance(faiss.downcast_index(inner.quantizer), faiss.IndexHNSW) else "flat"
            if isinstance(inner, faiss.IndexIVFPQ):
                return cls("ivfpq", nlist=inner.nlist, nprobe=inner.nprobe, pq_m=inner.pq.M, coarse=coarse)
            if isinstance(inner, faiss.IndexIVFPQFastScan):
                return cls("ivfpq", nlist=inner.nlist, nprobe=inner.nprobe, pq_m=inner.pq.M, coarse=coarse,
                           fastscan=True)
            if isinstance(inner, faiss.IndexIVFFlat):
                return cls("ivf", nlist=inner.nlist, nprobe=inner.nprobe, coarse=coarse)
        if isinstance(inner, faiss.IndexHNSW):
            return cls(
                "hnsw",
                hnsw_m=inner.hnsw.nb_neighbors(1),
                ef_search=inner.hnsw.efSearch,
                ef_construction=inner.hnsw.efConstruction,
            )
        if isinstance(inner, faiss.IndexFlat):
            return cls("flat")
        raise ValueError(f"unsupported index structure {type(outer).__name__}/{type(inner).__name__}")


def coarse_kind(params: AnnParams, nlist: int) -> str:
    """The IVF quantiser actually used: ``params.coarse``, or for "auto" HNSW from COARSE_HNSW_MIN cells
    (a flat quantiser costs nlist * d flops per query, which grows past an HNSW walk over the centroids at many cells)."""
    if params.coarse != "auto":
        return params.coarse
    return "hnsw" if nlist >= COARSE_HNSW_MIN else "flat"


def as_f32(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32)


def inner_index(index: faiss.Index) -> faiss.Index:
    outer = faiss.downcast_index(index)
    if isinstance(outer, faiss.IndexIDMap):
        return faiss.downcast_index(outer.index)
    return outer


def apply_search_params(index: faiss.Index, params: AnnParams) -> None:
    """Set the query-time knobs (nprobe, efSearch) on a CPU index."""
    inner = inner_index(index)
    if isinstance(inner, faiss.IndexIVF):
        inner.nprobe = int(min(inner.nlist, params.nprobe or default_nprobe(inner.nlist)))
        quantizer = faiss.downcast_index(inner.quantizer)
        if isinstance(quantizer, faiss.IndexHNSW):  # the graph must explore at least nprobe cells
            quantizer.hnsw.efSearch = int(max(64, 2 * inner.nprobe))
    elif isinstance(inner, faiss.IndexHNSW):
        inner.hnsw.efSearch = int(params.ef_search)


def is_gpu(index: faiss.Index) -> bool:
    """A GPU index, a replica/shard set of them (several GPUs), or an IDMap around either."""
    idx = faiss.downcast_index(index)
    if type(idx).__name__.startswith("Gpu"):
        return True
    if isinstance(idx, (faiss.IndexReplicas, faiss.IndexShards)):
        return idx.count() > 0 and is_gpu(idx.at(0))
    if isinstance(idx, faiss.IndexIDMap) and idx.index is not None:
        return is_gpu(idx.index)
    return False


def cpu_of(index: faiss.Index) -> faiss.Index:
    """The CPU copy of a GPU index (the index itself when it is on the CPU)."""
    if is_gpu(index):
        return faiss.index_gpu_to_cpu(index)
    return index
