"""The FAISS approximate nearest-neighbour index over unit vectors (inner product = cosine): build, search, save/load, add/remove.

Stage one of the two-stage search (SPEC section 4): the index holds the unit dual-tower video vectors and
returns the top-K videos by ``cos(t, v̄_j)``. The index types and their parameters are in
:mod:`gare_index.ann_params`, the GPU placement in :mod:`gare_index.ann_gpu`, the exact reference search and
the synthetic test data in :mod:`gare_index.ann_eval`.

Ids: the index returns the caller's int64 ids (``add_with_ids``); missing results have id -1 and score
``-inf``.  For ``ivfpq`` re-scoring, ``vectors[i]`` must be the vector of id ``i`` (or pass ``vector_ids``,
the id of every row of ``vectors``); vectors added later through :meth:`AnnIndex.add` are kept in memory.

Thread counts are left to faiss / ``OMP_NUM_THREADS``.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from pathlib import Path

import faiss
import numpy as np

from gare_index import ann_gpu
from gare_index.ann_params import (
    AnnParams,
    apply_search_params,
    as_f32,
    coarse_kind,
    cpu_of,
    default_nlist,
    default_pq_m,
    inner_index,
    is_gpu,
)
from gare_index.rescore import VectorStore, rescore

__all__ = ["build_index", "AnnIndex", "check_vectors", "train_ivf", "add_assigned"]

_ADD_BATCH = 65_536  # rows per add() call (bounds the float32 copy made from a memmap)

log = logging.getLogger(__name__)



def check_vectors(vectors: np.ndarray, ids: np.ndarray | None = None) -> tuple[int, int]:
    if vectors.ndim != 2:
        raise ValueError(f"vectors must be (n, d), got shape {vectors.shape}")
    n, d = vectors.shape
    if ids is not None and (ids.ndim != 1 or ids.shape[0] != n):
        raise ValueError(f"ids must be ({n},), got shape {ids.shape}")
    return n, d


def _add(index: faiss.Index, vectors: np.ndarray, ids: np.ndarray) -> None:
    for s in range(0, vectors.shape[0], _ADD_BATCH):
        e = min(vectors.shape[0], s + _ADD_BATCH)
        index.add_with_ids(as_f32(vectors[s:e]), np.ascontiguousarray(ids[s:e], dtype=np.int64))


def train_ivf(index: faiss.Index, sample: np.ndarray, *, clustering_index: faiss.Index | None = None) -> None:
    """Train an IVF index's coarse quantiser (and codes) on ``sample`` (m, d) float32; ``clustering_index`` (a
    flat inner-product index, e.g. on the GPU) assigns the points in k-means instead of the quantiser itself."""
    ivf = faiss.extract_index_ivf(index)
    if clustering_index is not None:
        ivf.clustering_index = clustering_index
    try:
        index.train(sample)
    finally:
        if clustering_index is not None:
            ivf.clustering_index = None  # the index must not outlive-reference the caller's (GPU) index


def add_assigned(index: faiss.Index, vectors: np.ndarray, ids: np.ndarray, assigner: faiss.Index) -> None:
    """Add ``vectors`` (n, d) with ``ids`` (n,) to a trained IVF index whose cells are chosen by ``assigner``: a
    flat inner-product index (CPU or GPU) loaded with the coarse centroids, searched for the top-1 cell of each
    row -- exactly what the index's own flat quantiser would choose (an HNSW quantiser's choice is approximate)."""
    ivf = faiss.extract_index_ivf(index)
    assigner.reset()
    assigner.add(as_f32(ivf.quantizer.reconstruct_n(0, ivf.nlist)))
    for s in range(0, vectors.shape[0], _ADD_BATCH):
        e = min(vectors.shape[0], s + _ADD_BATCH)
        x = np.ascontiguousarray(as_f32(vectors[s:e]))
        xid = np.ascontiguousarray(ids[s:e], dtype=np.int64)
        _, cell = assigner.search(x, 1)  # (b, 1) int64
        cell = np.ascontiguousarray(cell[:, 0])
        ivf.add_core(e - s, faiss.swig_ptr(x), faiss.swig_ptr(xid), faiss.swig_ptr(cell))
    assigner.reset()


def _training_sample(vectors: np.ndarray, nlist: int, seed: int = 1234, per_cell: int = 64) -> np.ndarray:
    n = vectors.shape[0]
    n_train = min(n, max(per_cell * nlist, 16_384))  # faiss uses at most 256 / cell; 64 is plenty
    if n_train == n:
        return as_f32(vectors)
    rows = np.sort(np.random.default_rng(seed).choice(n, size=n_train, replace=False))
    return as_f32(vectors[rows])


def build_index(
    vectors: np.ndarray,
    ids: np.ndarray,
    params: AnnParams,
    *,
    use_gpu: bool | None = None,
    assign_on_gpu: bool | None = None,
    coarse_from: faiss.Index | None = None,
) -> faiss.Index:
    """Build an index over ``vectors`` (n, d) float32 unit rows, answering with ``ids`` (n,) int64.

    ``flat``/``hnsw`` are wrapped in ``IndexIDMap2``; ``ivf``/``ivfpq`` take the ids natively.  IVF quantisers
    are trained on the data (a seeded sample of up to max(64 nlist, 16384) rows); ``nlist`` defaults to
    ``default_nlist(n)``.  With a GPU (``faiss.get_num_gpus() > 0`` and ``use_gpu`` not False) a ``flat`` or
    ``ivf`` index is returned cloned onto all GPUs as :func:`gare_index.ann_gpu.gpu_plan` says (GpuIndexError when
    ``use_gpu=True`` and it cannot be); :class:`AnnIndex` keeps and saves the CPU copy.  Otherwise the CPU
    index is returned.  ``assign_on_gpu`` (None: as ``use_gpu``) runs IVF's k-means assignments and IVF-Flat's
    cell assignments on the GPU while building (the same cells: :func:`add_assigned`), wherever it is searched.
    ``coarse_from``: an IVF index (CPU) over the same space with the same nlist and quantiser kind whose trained
    coarse quantiser is copied instead of running k-means again (the tuner builds IVF-Flat, then IVF-PQ on its cells).
    """
    ids = np.asarray(ids)
    n, d = check_vectors(vectors, ids)
    ids = ids.astype(np.int64, copy=False)
    t = params.index_type
    assigner: faiss.Index | None = None  # a (GPU) flat index that places IVF-Flat's rows in their cells
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
        if coarse_from is not None:
            quantizer = _trained_quantizer(coarse_from, nlist, d, coarse_kind(params, nlist))
        elif coarse_kind(params, nlist) == "hnsw":
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
        # With a GPU, k-means assigns its training sample with a GPU flat index, and IVF-Flat's rows are
        # assigned to their cells there too (exact; on the CPU both are an (n x nlist) product: minutes at 10M).
        accel = ann_gpu.coarse_accelerator(d, use_gpu if assign_on_gpu is None else assign_on_gpu)
        if t == "ivf" and coarse_from is not None:
            index.is_trained = True  # IVF-Flat has nothing to train beyond the copied quantiser
        else:  # (with a copied quantiser faiss trains only the product quantiser)
            train_ivf(index, _training_sample(vectors, nlist, per_cell=params.train_per_cell), clustering_index=accel)
        assigner = accel if t == "ivf" else None
    else:  # pragma: no cover - AnnParams validates
        raise ValueError(t)
    apply_search_params(index, params)
    if assigner is not None:
        add_assigned(index, vectors, ids, assigner)
    else:
        _add(index, vectors, ids)
    plan = ann_gpu.gpu_plan(index, params, use_gpu=use_gpu)
    if plan.error:
        raise ann_gpu.GpuIndexError(plan.error)
    for w in plan.warnings:
        log.warning("%s", w)
    if plan.on_gpu:
        return ann_gpu.to_gpu(index, plan)
    return index


def _trained_quantizer(source: faiss.Index, nlist: int, d: int, kind: str) -> faiss.Index:
    """A copy of ``source``'s trained coarse quantiser, checked to be what an index of (nlist, d, kind) needs; faiss
    then trains only what is left (IVF-PQ's product quantiser) and skips k-means."""
    ivf = faiss.extract_index_ivf(source)
    q = faiss.downcast_index(ivf.quantizer)
    have = "hnsw" if isinstance(q, faiss.IndexHNSW) else "flat"
    if int(ivf.nlist) != nlist or int(ivf.d) != d or have != kind or not q.is_trained or int(q.ntotal) != nlist:
        raise ValueError(f"coarse_from holds a {have} quantiser of {int(q.ntotal)} cells in d={int(ivf.d)}; "
                         f"this index needs a trained {kind} one of {nlist} cells in d={d}")
    return faiss.clone_index(q)


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
        n_gpus: int | None = None,
        k_max: int | None = None,
    ) -> None:
        """``use_gpu`` (False / None = when possible / True = required) and ``n_gpus`` (None: ask faiss) go to
        :func:`gare_index.ann_gpu.gpu_plan`, as does ``k_max`` (the largest k callers ask; only for a warning).  A flat/ivf index
        planned for the GPU is cloned here, not at the first search: GpuIndexError now if it cannot be.  A GPU
        ``index`` (from :func:`build_index`) is kept as the GPU copy, with ``params``' nprobe set on it."""
        given_gpu = is_gpu(index)
        self._cpu = cpu_of(index)
        self.params = params if params is not None else AnnParams.from_index(self._cpu)
        apply_search_params(self._cpu, self.params)
        self._store = VectorStore(vectors, vector_ids)
        self._use_gpu = True if given_gpu else use_gpu
        self._n_gpus = n_gpus
        self._k_max = k_max
        self._gpu_lock = threading.Lock()  # faiss GPU indexes (their StandardGpuResources) are not thread-safe
        self._warned_k = False
        self._gpu: faiss.Index | None = None
        self._gpu_stale = False
        self._plan = self._make_plan()
        if self._plan.on_gpu:
            self._gpu = index if given_gpu else ann_gpu.to_gpu(self._cpu, self._plan)
            if given_gpu and self._plan.nprobe is not None:
                ann_gpu.set_gpu_nprobe(self._gpu, self._plan)
        log.debug("ANN %s: %s", "GPU" if self._gpu is not None else "CPU", self._plan.reason)

    def _make_plan(self) -> ann_gpu.GpuPlan:
        plan = ann_gpu.gpu_plan(self._cpu, self.params, use_gpu=self._use_gpu, n_gpus=self._n_gpus, k_max=self._k_max)
        if plan.error:
            raise ann_gpu.GpuIndexError(plan.error)
        for w in plan.warnings:
            log.warning("%s", w)
        return plan

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

    @property
    def gpu_plan(self) -> ann_gpu.GpuPlan:
        """What :func:`gare_index.ann_gpu.gpu_plan` decided when this index was opened."""
        return self._plan

    @property
    def on_gpu(self) -> bool:
        """Whether searches (of at most ``gpu_plan.max_k`` results) run on the GPU copy."""
        return self._plan.on_gpu

    def _searcher(self, k: int) -> tuple[faiss.Index, bool]:
        """(the index to search for k results, whether it is the GPU copy)."""
        if not self._plan.on_gpu:
            return self._cpu, False
        if k > self._plan.max_k:  # beyond faiss's GPU k-selection: the CPU master copy answers, unclamped
            if not self._warned_k:
                self._warned_k = True
                log.warning("a search for k=%d results exceeds the faiss GPU limit of %d: answered by the CPU copy "
                            "of the %s (same results, CPU latency; logged once)", k, self._plan.max_k, self._plan.index)
            return self._cpu, False
        with self._gpu_lock:
            if self._gpu is None or self._gpu_stale:  # re-clone after add/remove, with the plan checked at open
                self._gpu = ann_gpu.to_gpu(self._cpu, self._plan)
                self._gpu_stale = False
            return self._gpu, True

    # -- search
    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-k by inner product: (scores (q, k) float32, ids (q, k) int64); missing: id -1, score -inf."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        q = as_f32(np.atleast_2d(queries))
        if q.shape[1] != self.d:
            raise ValueError(f"queries have d={q.shape[1]}, index has d={self.d}")
        nq = q.shape[0]
        if nq == 0 or self.ntotal == 0:
            return np.full((nq, k), -np.inf, dtype=np.float32), np.full((nq, k), -1, dtype=np.int64)
        rescore = self.params.index_type == "ivfpq" and self._store.available
        k_search = k * self.params.rescore if rescore else k
        searcher, gpu = self._searcher(k_search)
        if gpu:
            with self._gpu_lock:
                scores, ids = searcher.search(q, k_search)
        else:
            scores, ids = searcher.search(q, k_search)
        ids = ids.astype(np.int64, copy=False)
        if rescore:
            scores, ids = self._rescore(q, ids, k)
        scores = np.ascontiguousarray(scores, dtype=np.float32)
        scores[ids < 0] = -np.inf
        return scores, ids

    def scan_fraction(self) -> float | None:
        """The share of the rows one unfiltered search reads: nprobe / nlist for IVF (cells of about equal size),
        1 for flat; None for HNSW (the graph walk has no fixed share)."""
        inner = inner_index(self._cpu)
        if isinstance(inner, faiss.IndexIVF):
            return min(1.0, max(1, int(inner.nprobe)) / max(1, int(inner.nlist)))
        if isinstance(inner, faiss.IndexHNSW):
            return None
        return 1.0

    def search_subset(self, queries: np.ndarray, k: int, allowed: np.ndarray | None = None, *, widen: int = 1,
                      bits: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, bool]:
        """Top-k by inner product among the ids whose bit is set in `allowed` ((max id + 1,) bool), or in `bits`
        (the same packed, bit i = id i: what :func:`gare_index.filter_cache.id_bitmap` gives) -- the filter
        inside the ANN, a faiss IDSelectorBitmap: (scores (q, k), ids (q, k), exhaustive). IVF scans `widen`
        times its nprobe cells and HNSW explores `widen` times its efSearch (a selective filter leaves few passing
        rows in the cells it would scan); `exhaustive` says whether that breadth already covers every row (flat,
        or IVF with every cell scanned), so that a shorter answer means fewer rows pass. Always on the CPU copy
        (faiss's GPU indexes take no selector)."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        q = as_f32(np.atleast_2d(queries))
        if q.shape[1] != self.d:
            raise ValueError(f"queries have d={q.shape[1]}, index has d={self.d}")
        nq = q.shape[0]
        if nq == 0 or self.ntotal == 0:
            return np.full((nq, k), -np.inf, dtype=np.float32), np.full((nq, k), -1, dtype=np.int64), True
        if (allowed is None) == (bits is None):
            raise ValueError("search_subset takes one of allowed (bool per id) or bits (packed)")
        if bits is None:
            bits = np.packbits(np.asarray(allowed, dtype=bool), bitorder="little")  # bit i = id i (faiss's layout)
        bits = np.ascontiguousarray(bits, dtype=np.uint8)
        sel = faiss.IDSelectorBitmap(int(bits.size), faiss.swig_ptr(bits))  # n = bytes of the bitmap
        inner = inner_index(self._cpu)
        exhaustive = True
        if isinstance(inner, faiss.IndexIVF):
            nprobe = int(min(inner.nlist, max(1, int(inner.nprobe)) * max(1, int(widen))))
            params: faiss.SearchParameters = faiss.SearchParametersIVF(sel=sel, nprobe=nprobe)
            exhaustive = nprobe >= int(inner.nlist)
        elif isinstance(inner, faiss.IndexHNSW):
            params = faiss.SearchParametersHNSW(sel=sel, efSearch=int(max(k, inner.hnsw.efSearch * max(1, int(widen)))))
            exhaustive = False
        else:
            params = faiss.SearchParameters(sel=sel)
        rescore = self.params.index_type == "ivfpq" and self._store.available
        k_search = k * self.params.rescore if rescore else k
        scores, ids = self._cpu.search(q, k_search, params=params)
        del bits  # the selector read it during the search (kept alive until here)
        ids = ids.astype(np.int64, copy=False)
        if rescore:
            scores, ids = self._rescore(q, ids, k)
        scores = np.ascontiguousarray(scores, dtype=np.float32)
        scores[ids < 0] = -np.inf
        return scores, ids, exhaustive

    def _rescore(self, q: np.ndarray, cand: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        return rescore(self._store, q, cand, k)

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
        n_gpus: int | None = None,
        k_max: int | None = None,
    ) -> AnnIndex:
        """Read an index written by :meth:`save`.  ``params`` (default: recovered from the file) set the
        query-time knobs (nprobe, ef_search, rescore); its index_type must match the file.  ``use_gpu=None``
        moves flat/ivf to the GPU when faiss has one and :func:`gare_index.ann_gpu.gpu_plan` allows (``n_gpus``, ``k_max``: as
        for the constructor); the clone happens here, so GpuIndexError is raised by ``load``.  ``mmap=True`` maps the flat codes (flat, HNSW storage)
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
        return cls(index, params, vectors, vector_ids=vector_ids, use_gpu=use_gpu, n_gpus=n_gpus, k_max=k_max)

    # -- incremental updates
    def add(self, vectors: np.ndarray, ids: np.ndarray) -> None:
        """Add vectors under ids (the caller removes an id first to replace it; faiss does not dedupe).

        IVF cells stay as trained: after large additions, rebuild to re-train the quantiser."""
        ids = np.asarray(ids, dtype=np.int64)
        n, d = check_vectors(vectors, ids)
        if d != self.d:
            raise ValueError(f"vectors have d={d}, index has d={self.d}")
        if n == 0:
            return
        _add(self._cpu, vectors, ids)
        if self.params.index_type == "ivfpq" and self._store.available:
            self._store.add(vectors, ids)
        self._gpu_stale = True

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
        self._gpu_stale = True
        return removed

    def _rebuild_hnsw_without(self, ids: np.ndarray) -> int:
        outer = faiss.downcast_index(self._cpu)
        inner = inner_index(self._cpu)
        id_map = faiss.vector_to_array(outer.id_map).astype(np.int64)
        keep = ~np.isin(id_map, ids)
        removed = int((~keep).sum())
        if removed == 0:
            return 0
        xb = inner.reconstruct_n(0, inner.ntotal)
        self._cpu = build_index(xb[keep], id_map[keep], self.params, use_gpu=False)
        return removed
