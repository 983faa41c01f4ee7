"""FAISS approximate nearest-neighbour indexes over unit vectors (inner product = cosine).

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
which query-time knobs meet a recall target: ``indexer.tune``.

Ids: the index returns the caller's int64 ids (``add_with_ids``); missing results have id -1 and score
``-inf``.  For ``ivfpq`` re-scoring, ``vectors[i]`` must be the vector of id ``i`` (or pass ``vector_ids``,
the id of every row of ``vectors``); vectors added later through :meth:`AnnIndex.add` are kept in memory.

GPU: with ``faiss.get_num_gpus() > 0`` (a faiss-gpu build) and ``use_gpu`` not False, ``flat`` and ``ivf``
indexes are searched on the GPU(s) via ``index_cpu_to_all_gpus``; the CPU index stays the master copy
(that is what is saved, and mutations are applied to it and re-cloned).  Thread counts are left to faiss /
``OMP_NUM_THREADS``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import faiss
import numpy as np

__all__ = [
    "INDEX_TYPES",
    "FLAT_MAX",
    "IVFPQ_MIN",
    "COARSE_HNSW_MIN",
    "coarse_kind",
    "choose_index_type",
    "default_nlist",
    "default_nprobe",
    "default_pq_m",
    "AnnParams",
    "build_index",
    "AnnIndex",
    "exact_search",
    "recall_at_k",
    "clustered_vectors",
    "perturbed_queries",
]

INDEX_TYPES = ("flat", "ivf", "hnsw", "ivfpq")

# choose_index_type thresholds: exact search is cheap enough (and exact) below FLAT_MAX items; IVF-Flat
# (exact scores in the probed cells, cheap to build, supports removal for incremental updates) up to
# IVFPQ_MIN; compressed IVF-PQ with exact re-scoring beyond (at d = 512 float32, 5M vectors are 10 GB).
FLAT_MAX = 50_000
IVFPQ_MIN = 5_000_000
COARSE_HNSW_MIN = 16_384  # IVF cells from which the coarse quantiser is an HNSW graph (coarse="auto")

_ADD_BATCH = 65_536  # rows per add() call (bounds the float32 copy made from a memmap)


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
    fastscan: bool = False  # ivfpq: 4-bit fast-scan PQ codes (SIMD lookups, ~5-10x faster scans) instead of 8-bit
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
        index = _cpu_of(index)
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


# --------------------------------------------------------------------------------------------- helpers
def _as_f32(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32)


def _check_vectors(vectors: np.ndarray, ids: np.ndarray | None = None) -> tuple[int, int]:
    if vectors.ndim != 2:
        raise ValueError(f"vectors must be (n, d), got shape {vectors.shape}")
    n, d = vectors.shape
    if ids is not None and (ids.ndim != 1 or ids.shape[0] != n):
        raise ValueError(f"ids must be ({n},), got shape {ids.shape}")
    return n, d


def _gpu_available(use_gpu: bool | None) -> bool:
    if use_gpu is False:
        return False
    try:
        n = faiss.get_num_gpus()
    except AttributeError:  # pragma: no cover - very old builds
        n = 0
    if use_gpu and n == 0:
        raise RuntimeError("use_gpu=True but faiss sees no GPU (install faiss-gpu and check CUDA)")
    return n > 0


def _is_gpu(index: faiss.Index) -> bool:
    idx = faiss.downcast_index(index)
    if type(idx).__name__.startswith("Gpu"):
        return True
    if isinstance(idx, faiss.IndexIDMap) and idx.index is not None:
        return type(faiss.downcast_index(idx.index)).__name__.startswith("Gpu")
    return False


def _cpu_of(index: faiss.Index) -> faiss.Index:
    if _is_gpu(index):
        return faiss.index_gpu_to_cpu(index)
    return index


def _inner(index: faiss.Index) -> faiss.Index:
    outer = faiss.downcast_index(index)
    if isinstance(outer, faiss.IndexIDMap):
        return faiss.downcast_index(outer.index)
    return outer


def _apply_search_params(index: faiss.Index, params: AnnParams) -> None:
    """Set the query-time knobs (nprobe, efSearch) on a CPU index."""
    inner = _inner(index)
    if isinstance(inner, faiss.IndexIVF):
        inner.nprobe = int(min(inner.nlist, params.nprobe or default_nprobe(inner.nlist)))
        quantizer = faiss.downcast_index(inner.quantizer)
        if isinstance(quantizer, faiss.IndexHNSW):  # the graph must explore at least nprobe cells
            quantizer.hnsw.efSearch = int(max(64, 2 * inner.nprobe))
    elif isinstance(inner, faiss.IndexHNSW):
        inner.hnsw.efSearch = int(params.ef_search)


def _to_gpu(cpu: faiss.Index, params: AnnParams) -> faiss.Index:
    gpu = faiss.index_cpu_to_all_gpus(cpu)
    try:  # nprobe is copied by the cloner, but set it on the GPU index too where exposed
        faiss.GpuParameterSpace().set_index_parameter(gpu, "nprobe", int(_inner(cpu).nprobe))
    except Exception:  # noqa: BLE001 - flat indexes have no nprobe; best effort only
        pass
    return gpu


def _add(index: faiss.Index, vectors: np.ndarray, ids: np.ndarray) -> None:
    for s in range(0, vectors.shape[0], _ADD_BATCH):
        e = min(vectors.shape[0], s + _ADD_BATCH)
        index.add_with_ids(_as_f32(vectors[s:e]), np.ascontiguousarray(ids[s:e], dtype=np.int64))


def coarse_kind(params: AnnParams, nlist: int) -> str:
    """The IVF quantiser actually used: ``params.coarse``, or for "auto" HNSW from COARSE_HNSW_MIN cells
    (a flat quantiser costs nlist * d flops per query: 8 ms at 65k cells, 0.1 ms at 4k)."""
    if params.coarse != "auto":
        return params.coarse
    return "hnsw" if nlist >= COARSE_HNSW_MIN else "flat"


def _training_sample(vectors: np.ndarray, nlist: int, seed: int = 1234, per_cell: int = 64) -> np.ndarray:
    n = vectors.shape[0]
    n_train = min(n, max(per_cell * nlist, 16_384))  # faiss uses at most 256 / cell; 64 is plenty
    if n_train == n:
        return _as_f32(vectors)
    rows = np.sort(np.random.default_rng(seed).choice(n, size=n_train, replace=False))
    return _as_f32(vectors[rows])


def build_index(
    vectors: np.ndarray,
    ids: np.ndarray,
    params: AnnParams,
    *,
    use_gpu: bool | None = None,
) -> faiss.Index:
    """Build an index over ``vectors`` (n, d) float32 unit rows, answering with ``ids`` (n,) int64.

    ``flat``/``hnsw`` are wrapped in ``IndexIDMap2``; ``ivf``/``ivfpq`` take the ids natively.  IVF quantisers
    are trained on the data (a seeded sample of up to max(64 nlist, 16384) rows); ``nlist`` defaults to
    ``default_nlist(n)``.  With a GPU (``faiss.get_num_gpus() > 0`` and ``use_gpu`` not False) a ``flat`` or
    ``ivf`` index is returned cloned onto all GPUs (``index_cpu_to_all_gpus``); :class:`AnnIndex` keeps and
    saves the CPU copy.  Otherwise the CPU index is returned.
    """
    ids = np.asarray(ids)
    n, d = _check_vectors(vectors, ids)
    ids = ids.astype(np.int64, copy=False)
    t = params.index_type
    if t == "flat":
        index = faiss.IndexIDMap2(faiss.IndexFlatIP(d))
    elif t == "hnsw":
        inner = faiss.IndexHNSWFlat(d, int(params.hnsw_m), faiss.METRIC_INNER_PRODUCT)
        inner.hnsw.efConstruction = int(params.ef_construction)
        inner.hnsw.efSearch = int(params.ef_search)
        index = faiss.IndexIDMap2(inner)
    elif t in ("ivf", "ivfpq"):
        if n == 0:
            raise ValueError(f"an {t} index needs training vectors; got none")
        nlist = int(min(params.nlist or default_nlist(n), n))
        if coarse_kind(params, nlist) == "hnsw":
            quantizer = faiss.IndexHNSWFlat(d, 32, faiss.METRIC_INNER_PRODUCT)
            quantizer.hnsw.efConstruction = 80
        else:
            quantizer = faiss.IndexFlatIP(d)
        if t == "ivf":
            index = faiss.IndexIVFFlat(quantizer, d, nlist, faiss.METRIC_INNER_PRODUCT)
        else:
            pq_m = int(params.pq_m or default_pq_m(d))
            if d % pq_m:
                raise ValueError(f"pq_m={pq_m} must divide d={d}")
            if params.fastscan:  # 4-bit codes scanned 32 at a time with SIMD table lookups
                index = faiss.IndexIVFPQFastScan(quantizer, d, nlist, pq_m, 4, faiss.METRIC_INNER_PRODUCT)
            else:
                # 8-bit codes need >= 256 training points per sub-quantiser; shrink for tiny galleries.
                nbits = int(max(1, min(8, math.floor(math.log2(max(2, n // 4))))))
                index = faiss.IndexIVFPQ(quantizer, d, nlist, pq_m, nbits, faiss.METRIC_INNER_PRODUCT)
        index.train(_training_sample(vectors, nlist, per_cell=params.train_per_cell))
    else:  # pragma: no cover - AnnParams validates
        raise ValueError(t)
    _apply_search_params(index, params)
    _add(index, vectors, ids)
    if t in ("flat", "ivf") and _gpu_available(use_gpu):
        return _to_gpu(index, params)
    return index


# ------------------------------------------------------------------------------------- vector lookup
class _VectorStore:
    """id -> float32 vector for exact re-scoring: a base array (memmap ok) plus rows added later."""

    def __init__(self, base: np.ndarray | None, base_ids: np.ndarray | None) -> None:
        self.base = base
        self.d = None if base is None else base.shape[1]
        if base is not None and base_ids is not None:
            base_ids = np.asarray(base_ids, dtype=np.int64)
            if base_ids.shape != (base.shape[0],):
                raise ValueError(f"vector_ids must be ({base.shape[0]},), got {base_ids.shape}")
            order = np.argsort(base_ids, kind="stable")
            self._base_sorted, self._base_rows = base_ids[order], order
        else:
            self._base_sorted = self._base_rows = None
        self._extra_ids = np.zeros(0, dtype=np.int64)  # sorted
        self._extra_vecs = np.zeros((0, self.d or 0), dtype=np.float32)

    @property
    def available(self) -> bool:
        return self.base is not None or self._extra_ids.size > 0

    def add(self, vectors: np.ndarray, ids: np.ndarray) -> None:
        vectors = _as_f32(vectors)
        if self.d is None:
            self.d = vectors.shape[1]
            self._extra_vecs = np.zeros((0, self.d), dtype=np.float32)
        keep = ~np.isin(self._extra_ids, ids)  # a re-added id replaces its previous vector
        all_ids = np.concatenate([self._extra_ids[keep], ids.astype(np.int64)])
        all_vecs = np.concatenate([self._extra_vecs[keep], vectors])
        order = np.argsort(all_ids, kind="stable")
        self._extra_ids, self._extra_vecs = all_ids[order], all_vecs[order]

    @staticmethod
    def _find(sorted_ids: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if sorted_ids.size == 0:
            return np.zeros(ids.shape, dtype=bool), np.zeros(ids.shape, dtype=np.int64)
        pos = np.clip(np.searchsorted(sorted_ids, ids), 0, sorted_ids.size - 1)
        return sorted_ids[pos] == ids, pos

    def get(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(vectors (m, d) float32, found (m,) bool) for ids (m,); later additions take precedence."""
        ids = np.asarray(ids, dtype=np.int64)
        out = np.zeros((ids.shape[0], self.d or 0), dtype=np.float32)
        found = np.zeros(ids.shape[0], dtype=bool)
        in_extra, pos = self._find(self._extra_ids, ids)
        if in_extra.any():
            out[in_extra] = self._extra_vecs[pos[in_extra]]
            found |= in_extra
        if self.base is not None:
            need = ~found & (ids >= 0)
            if self._base_sorted is None:
                ok = need & (ids < self.base.shape[0])
                rows = ids
            else:
                hit, p = self._find(self._base_sorted, ids)
                ok = need & hit
                rows = np.where(hit, self._base_rows[p], 0)
            if ok.any():
                uniq, inv = np.unique(rows[ok], return_inverse=True)  # sorted reads: memmap friendly
                out[ok] = np.asarray(self.base[uniq], dtype=np.float32)[inv]
                found |= ok
        return out, found


# ------------------------------------------------------------------------------------------- wrapper
class AnnIndex:
    """The index used by the indexer and the service: search, save/load, incremental add/remove.

    ``vectors`` (row i = vector of id i, or of ``vector_ids[i]``; a memmap is fine) is needed only for the
    exact re-scoring of ``ivfpq`` results; without it ``ivfpq`` returns the PQ-approximate top k.
    """

    def __init__(
        self,
        index: faiss.Index,
        params: AnnParams | None = None,
        vectors: np.ndarray | None = None,
        *,
        vector_ids: np.ndarray | None = None,
        use_gpu: bool | None = False,
    ) -> None:
        self._cpu = _cpu_of(index)
        self.params = params if params is not None else AnnParams.from_index(self._cpu)
        self._want_gpu = _is_gpu(index) or (
            self.params.index_type in ("flat", "ivf") and _gpu_available(use_gpu)
        )
        _apply_search_params(self._cpu, self.params)
        if _is_gpu(index):
            self._search_index: faiss.Index | None = index
        else:
            self._search_index = None  # cloned lazily (or the CPU index itself)
        self._store = _VectorStore(vectors, vector_ids)

    # -- properties
    @property
    def ntotal(self) -> int:
        return int(self._cpu.ntotal)

    @property
    def d(self) -> int:
        return int(self._cpu.d)

    @property
    def cpu_index(self) -> faiss.Index:
        return self._cpu

    def _searcher(self) -> faiss.Index:
        if not self._want_gpu:
            return self._cpu
        if self._search_index is None:
            self._search_index = _to_gpu(self._cpu, self.params)
        return self._search_index

    # -- search
    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-k by inner product: (scores (q, k) float32, ids (q, k) int64); missing: id -1, score -inf."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        q = _as_f32(np.atleast_2d(queries))
        if q.shape[1] != self.d:
            raise ValueError(f"queries have d={q.shape[1]}, index has d={self.d}")
        nq = q.shape[0]
        if nq == 0 or self.ntotal == 0:
            return np.full((nq, k), -np.inf, dtype=np.float32), np.full((nq, k), -1, dtype=np.int64)
        rescore = self.params.index_type == "ivfpq" and self._store.available
        k_search = k * self.params.rescore if rescore else k
        scores, ids = self._searcher().search(q, k_search)
        ids = ids.astype(np.int64, copy=False)
        if rescore:
            scores, ids = self._rescore(q, ids, k)
        scores = np.ascontiguousarray(scores, dtype=np.float32)
        scores[ids < 0] = -np.inf
        return scores, ids

    def _rescore(self, q: np.ndarray, cand: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        nq, kk = cand.shape
        d = q.shape[1]
        out_s = np.full((nq, k), -np.inf, dtype=np.float32)
        out_i = np.full((nq, k), -1, dtype=np.int64)
        step = max(1, (1 << 24) // max(1, kk * d))  # ~64 MB of gathered float32 vectors per batch
        for s in range(0, nq, step):
            e = min(nq, s + step)
            c = cand[s:e]
            vecs, found = self._store.get(c.reshape(-1))
            vecs = vecs.reshape(e - s, kk, d)
            found = found.reshape(e - s, kk) & (c >= 0)
            sc = np.einsum("qkd,qd->qk", vecs, q[s:e]).astype(np.float32)
            sc[~found] = -np.inf
            order = np.argsort(-sc, axis=1, kind="stable")[:, :k]
            sel_s = np.take_along_axis(sc, order, 1)
            sel_i = np.take_along_axis(c, order, 1)
            sel_i[~np.isfinite(sel_s)] = -1
            out_s[s:e, : order.shape[1]] = sel_s
            out_i[s:e, : order.shape[1]] = sel_i
        return out_s, out_i

    # -- persistence
    def save(self, path: str | os.PathLike) -> None:
        """Write the CPU index atomically (temp file in the same folder, then os.replace)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            faiss.write_index(self._cpu, str(tmp))
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        params: AnnParams | None = None,
        vectors: np.ndarray | None = None,
        use_gpu: bool | None = None,
        *,
        vector_ids: np.ndarray | None = None,
        mmap: bool = False,
    ) -> AnnIndex:
        """Read an index written by :meth:`save`.  ``params`` (default: recovered from the file) set the
        query-time knobs (nprobe, ef_search, rescore); its index_type must match the file.  ``use_gpu=None``
        moves flat/ivf to the GPU when faiss has one.  ``mmap=True`` maps the flat codes (flat, HNSW storage)
        read-only from the file instead of copying them (IVF inverted lists are still read into memory), so several serving processes share one
        copy through the page cache; such an index must never be modified (add/remove)."""
        if mmap:
            # IO_FLAG_MMAP_IFC maps flat codes (flat, HNSW storage); faiss 1.15 cannot also map IVF lists
            # read through this path ("mmap only supported for File objects"), so IVF lists are still copied
            index = faiss.read_index(str(path), faiss.IO_FLAG_MMAP_IFC | faiss.IO_FLAG_READ_ONLY)
        else:
            index = faiss.read_index(str(path))
        found = AnnParams.from_index(index)
        if params is None:
            params = found
        elif params.index_type != found.index_type:
            raise ValueError(f"{path} holds a {found.index_type!r} index, params say {params.index_type!r}")
        return cls(index, params, vectors, vector_ids=vector_ids, use_gpu=use_gpu)

    # -- incremental updates
    def add(self, vectors: np.ndarray, ids: np.ndarray) -> None:
        """Add vectors under ids (the caller removes an id first to replace it; faiss does not dedupe).

        IVF cells stay as trained: after large additions, rebuild to re-train the quantiser."""
        ids = np.asarray(ids, dtype=np.int64)
        n, d = _check_vectors(vectors, ids)
        if d != self.d:
            raise ValueError(f"vectors have d={d}, index has d={self.d}")
        if n == 0:
            return
        _add(self._cpu, vectors, ids)
        if self.params.index_type == "ivfpq" and self._store.available:
            self._store.add(vectors, ids)
        self._search_index = None

    def remove_ids(self, ids: np.ndarray) -> int:
        """Remove ids; returns how many vectors were removed.

        faiss cannot delete from an HNSW graph: for ``hnsw`` the index is rebuilt from the vectors it
        stores (every id except the removed ones), which costs a full O(n log n) build."""
        ids = np.unique(np.asarray(ids, dtype=np.int64))
        if ids.size == 0 or self.ntotal == 0:
            return 0
        if self.params.index_type == "hnsw":
            return self._rebuild_hnsw_without(ids)
        removed = int(self._cpu.remove_ids(ids))
        self._search_index = None
        return removed

    def _rebuild_hnsw_without(self, ids: np.ndarray) -> int:
        outer = faiss.downcast_index(self._cpu)
        inner = _inner(self._cpu)
        id_map = faiss.vector_to_array(outer.id_map).astype(np.int64)
        keep = ~np.isin(id_map, ids)
        removed = int((~keep).sum())
        if removed == 0:
            return 0
        xb = inner.reconstruct_n(0, inner.ntotal)
        self._cpu = build_index(xb[keep], id_map[keep], self.params, use_gpu=False)
        self._search_index = None
        return removed


# ----------------------------------------------------------------------------- reference and helpers
def exact_search(
    vectors: np.ndarray, queries: np.ndarray, k: int, *, block: int = 1024
) -> tuple[np.ndarray, np.ndarray]:
    """Brute-force inner-product top-k in numpy: (scores (q, k) float32, row positions (q, k) int64).

    Ties are broken by the lower position; k is capped at len(vectors).
    """
    x = _as_f32(vectors)
    q = _as_f32(np.atleast_2d(queries))
    n = x.shape[0]
    k_eff = min(k, n)
    scores = np.empty((q.shape[0], k_eff), dtype=np.float32)
    pos = np.empty((q.shape[0], k_eff), dtype=np.int64)
    for s in range(0, q.shape[0], block):
        e = min(q.shape[0], s + block)
        sim = q[s:e] @ x.T
        if k_eff < n:
            part = np.argpartition(-sim, k_eff - 1, axis=1)[:, :k_eff]
        else:
            part = np.broadcast_to(np.arange(n), (e - s, n))
        ps = np.take_along_axis(sim, part, 1)
        order = np.lexsort((part, -ps), axis=1)
        pos[s:e] = np.take_along_axis(part, order, 1)
        scores[s:e] = np.take_along_axis(ps, order, 1)
    return scores, pos


def recall_at_k(approx_ids: np.ndarray, exact_ids: np.ndarray, k: int) -> float:
    """Mean over queries of |approx top-k ∩ exact top-k| / k (-1 entries never count)."""
    a = np.asarray(approx_ids)[:, :k]
    b = np.asarray(exact_ids)[:, :k]
    if a.shape[0] != b.shape[0]:
        raise ValueError("approx_ids and exact_ids must have the same number of queries")
    if a.shape[0] == 0:
        return float("nan")
    hits = 0
    for ra, rb in zip(a, b, strict=True):
        hits += np.intersect1d(ra[ra >= 0], rb[rb >= 0]).size
    return hits / (a.shape[0] * k)


def _normalize_rows(x: np.ndarray) -> np.ndarray:
    return (x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)).astype(np.float32)


def clustered_vectors(n: int, d: int, n_clusters: int, seed: int, spread: float = 0.1) -> np.ndarray:
    """(n, d) float32 unit vectors around ``n_clusters`` random unit centres (test and bench data).

    Each vector is ``normalize(centre + spread * g / sqrt(d))`` with g standard normal, so ``spread`` is
    roughly the norm of the offset from the centre before re-normalisation.
    """
    rng = np.random.default_rng(seed)
    centres = _normalize_rows(rng.standard_normal((n_clusters, d)))
    assign = rng.integers(0, n_clusters, size=n)
    x = centres[assign] + spread * rng.standard_normal((n, d)).astype(np.float32) / math.sqrt(d)
    return _normalize_rows(x)


def perturbed_queries(vectors: np.ndarray, n: int, seed: int, noise: float = 0.05) -> np.ndarray:
    """(n, d) unit queries: random members of ``vectors`` perturbed by ``noise * g / sqrt(d)``."""
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, vectors.shape[0], size=n)
    d = vectors.shape[1]
    q = np.asarray(vectors[rows], dtype=np.float32) + noise * rng.standard_normal((n, d)).astype(
        np.float32
    ) / math.sqrt(d)
    return _normalize_rows(q)
