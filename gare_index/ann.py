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
which query-time knobs meet a recall target: ``gare_build.tune``.

Ids: the index returns the caller's int64 ids (``add_with_ids``); missing results have id -1 and score
``-inf``.  For ``ivfpq`` re-scoring, ``vectors[i]`` must be the vector of id ``i`` (or pass ``vector_ids``,
the id of every row of ``vectors``); vectors added later through :meth:`AnnIndex.add` are kept in memory.

GPU: with ``faiss.get_num_gpus() > 0`` (a faiss-gpu build) and ``use_gpu`` not False, ``flat`` and ``ivf``
indexes are searched on the GPU(s) via ``index_cpu_to_all_gpus``; the CPU index stays the master copy
(that is what is saved, and mutations are applied to it and re-cloned).  :func:`gpu_plan` decides, from the
CPU index alone, what goes to the GPU and how (one pure function, tested on CPU-only machines):

- ``hnsw`` and ``ivfpq`` (8-bit and fast-scan) stay on the CPU: faiss has no GPU HNSW or fast-scan IVF-PQ
  (its GPU cloner throws "not implemented on GPU"), and ``ivfpq`` re-scores its shortlist exactly from the
  float vectors on the CPU;
- an ``ivf`` index whose coarse quantiser is an HNSW graph (``coarse="hnsw"``, automatic from
  ``COARSE_HNSW_MIN`` cells) is cloned with ``allowCpuCoarseQuantizer`` (faiss >= 1.9 throws without it;
  the graph is searched on the CPU, the inverted lists on the GPU);
- faiss's GPU k-selection handles at most ``GPU_MAX_K`` = 2,048 (``GPU_MAX_SELECTION_K`` in
  ``faiss/gpu/utils/DeviceDefs.cuh``, the same from faiss 1.8 to 1.15, checked by ``validateKSelect`` /
  ``validateNProbe`` in ``faiss/gpu/impl/IndexUtils.cu``; cuVS builds allow 16,384, but the plan turns
  cuVS off so that one limit and one code path hold): an ``ivf`` index whose nprobe exceeds it is refused
  with ``use_gpu=True`` and searched on the CPU (with a warning) under ``use_gpu=None``, never clamped
  (a clamped nprobe would silently serve a lower recall than the one the index was tuned to); a search
  for more than 2,048 results is answered by the CPU master copy (same results, CPU latency), never clamped;
- the clone happens when the :class:`AnnIndex` is made (``AnnIndex.load``, ``gare_index.store.open_index``),
  so a GPU that cannot take the index fails the service at start-up with :class:`GpuIndexError`, not at
  the first request; after ``add``/``remove_ids`` the copy is re-cloned at the next search.

Thread counts are left to faiss / ``OMP_NUM_THREADS``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import threading
from dataclasses import dataclass, field
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
    "GPU_MAX_K",
    "GpuPlan",
    "GpuIndexError",
    "gpu_plan",
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

# faiss GPU k-selection limit: GPU_MAX_SELECTION_K (faiss/gpu/utils/DeviceDefs.cuh) is 2048 for every CUDA build
# from faiss 1.8 to 1.15 (1024 only for CUDA <= 9.0); GpuIndex::search (validateKSelect) and GpuIndexIVF
# (validateNProbe, at copyFrom and at every search) throw above it.  cuVS builds allow 16384, but gpu_plan turns
# cuVS off.  Both nprobe (cells selected per query) and k (results) are bounded by it.
GPU_MAX_K = 2048

log = logging.getLogger(__name__)


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


def _num_gpus() -> int:
    """GPUs faiss can use (0 for a faiss-cpu build)."""
    try:
        return int(faiss.get_num_gpus())
    except AttributeError:  # pragma: no cover - very old builds
        return 0


def _gpu_available(use_gpu: bool | None) -> bool:
    if use_gpu is False:
        return False
    n = _num_gpus()
    if use_gpu and n == 0:
        raise GpuIndexError("use_gpu=True but faiss sees no GPU (install faiss-gpu and check CUDA)")
    return n > 0


def _is_gpu(index: faiss.Index) -> bool:
    """A GPU index, a replica/shard set of them (several GPUs), or an IDMap around either."""
    idx = faiss.downcast_index(index)
    if type(idx).__name__.startswith("Gpu"):
        return True
    if isinstance(idx, (faiss.IndexReplicas, faiss.IndexShards)):
        return idx.count() > 0 and _is_gpu(idx.at(0))
    if isinstance(idx, faiss.IndexIDMap) and idx.index is not None:
        return _is_gpu(idx.index)
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


# ------------------------------------------------------------------------------------------------- GPU
_GPU_OFF = "to search it on the CPU instead, set use_gpu_ann: false (GARE_USE_GPU_ANN=false; use_gpu=False in Python)"


class GpuIndexError(RuntimeError):
    """The index cannot be searched on the GPU as asked: raised when the index is built or opened (the plan
    and the clone), not at its first search (only a re-clone after add/remove waits for the next search)."""


@dataclass(frozen=True)
class GpuPlan:
    """What :func:`gpu_plan` decided for one index (see the module docstring)."""

    on_gpu: bool  # clone the index to the GPU(s) and search there
    reason: str  # why (or why not), one line
    index: str  # the index described: type, faiss class, nlist / nprobe / coarse quantiser, vectors
    n_gpus: int = 0
    # GpuMultipleClonerOptions fields to set (those the installed faiss has; see _to_gpu)
    cloner_options: dict[str, bool] = field(default_factory=dict)
    nprobe: int | None = None  # ivf: nprobe set on the GPU copy (<= max_k)
    max_k: int = GPU_MAX_K  # largest k (results per query) the GPU copy answers; larger k search the CPU copy
    error: str | None = None  # opening must fail with this message (use_gpu=True and the GPU cannot run it)
    warnings: tuple[str, ...] = ()  # logged at WARNING when the index is opened


def _nprobe_of(inner: faiss.Index, params: AnnParams | None) -> int:
    """The nprobe ``_apply_search_params`` gives an IVF index under ``params`` (the index's own without)."""
    if params is None:
        return int(inner.nprobe)
    return int(min(inner.nlist, params.nprobe or default_nprobe(inner.nlist)))


def _describe(inner: faiss.Index, params: AnnParams | None = None) -> str:
    if params is not None:
        t = params.index_type
    elif isinstance(inner, faiss.IndexIVF):
        t = "ivfpq" if isinstance(inner, (faiss.IndexIVFPQ, faiss.IndexIVFPQFastScan)) else "ivf"
    else:
        t = "hnsw" if isinstance(inner, faiss.IndexHNSW) else "flat" if isinstance(inner, faiss.IndexFlat) else "?"
    s = f"{t} index ({type(inner).__name__}, {int(inner.ntotal)} vectors of d={int(inner.d)}"
    if isinstance(inner, faiss.IndexIVF):
        q = faiss.downcast_index(inner.quantizer)
        s += f", nlist={int(inner.nlist)}, nprobe={_nprobe_of(inner, params)}, coarse quantiser {type(q).__name__}"
    return s + ")"


def gpu_plan(
    index: faiss.Index,
    params: AnnParams | None = None,
    *,
    use_gpu: bool | None = None,
    n_gpus: int | None = None,
    k_max: int | None = None,
    max_select: int | None = None,
) -> GpuPlan:
    """Decide whether and how the CPU ``index`` is searched on the GPU; pure (faiss-cpu is enough to run it).

    ``use_gpu``: False = never; None = when faiss sees a GPU and the index can run there as configured;
    True = the GPU is required (what cannot run there as configured is an ``error``; types faiss has no
    GPU version of stay on the CPU with a warning).  ``n_gpus``: GPUs faiss sees (None: ask faiss; tests
    pass a number).  ``k_max``: the largest k callers will ask (e.g. the service's max candidates), only
    for a warning: k above ``max_select`` (default GPU_MAX_K) are answered by the CPU copy.  ``index``:
    the CPU index (a GPU one is copied back first); the nprobe checked is the one ``params`` give it (as
    ``_apply_search_params`` sets it), or the index's own when ``params`` is None.
    """
    max_select = GPU_MAX_K if max_select is None else int(max_select)
    inner = _inner(_cpu_of(index))
    desc = _describe(inner, params)
    if use_gpu is False:
        return GpuPlan(False, "use_gpu=False", desc)
    cpu_only = None
    if isinstance(inner, faiss.IndexHNSW):
        cpu_only = "faiss has no GPU HNSW index (its GPU cloner throws 'not implemented on GPU')"
    elif isinstance(inner, faiss.IndexIVFPQFastScan):
        cpu_only = "faiss has no GPU fast-scan IVF-PQ (its GPU cloner throws 'not implemented on GPU')"
    elif isinstance(inner, faiss.IndexIVFPQ):
        cpu_only = ("ivfpq re-scores its shortlist exactly from the float vectors on the CPU, and GpuIndexIVFPQ "
                    "takes only some code sizes (8-bit codes; <= 48 bytes per vector without float16 tables)")
    elif not isinstance(inner, (faiss.IndexFlat, faiss.IndexIVFFlat)):
        cpu_only = f"{type(inner).__name__} is not one of the types searched on the GPU (flat, ivf)"
    if cpu_only is not None:
        warn = (f"use_gpu=True: the {desc} stays on the CPU: {cpu_only}",) if use_gpu else ()
        return GpuPlan(False, cpu_only, desc, warnings=warn)
    n = _num_gpus() if n_gpus is None else int(n_gpus)
    if n <= 0:
        err = "use_gpu=True but faiss sees no GPU (install faiss-gpu and check CUDA)" if use_gpu else None
        return GpuPlan(False, "faiss sees no GPU", desc, error=err)
    # exact float32 scores (the GPU copy must return the CPU index's ids); the classic faiss GPU kernels (cuVS
    # off: the limit below and the faiss coarse quantiser apply); 64-bit ids (the default)
    opts: dict[str, bool] = {"useFloat16": False, "useFloat16CoarseQuantizer": False, "use_cuvs": False,
                             "use_raft": False}
    nprobe = None
    warnings: list[str] = []
    if isinstance(inner, faiss.IndexIVF):
        coarse = faiss.downcast_index(inner.quantizer)
        if not isinstance(coarse, faiss.IndexFlat):
            # GpuIndexIVF::copyFrom clones the quantiser with the GPU cloner, which throws for an HNSW graph
            # unless allowCpuCoarseQuantizer (faiss >= 1.9); the graph is then searched on the CPU
            opts["allowCpuCoarseQuantizer"] = True
        nprobe = _nprobe_of(inner, params)
        if nprobe > max_select:
            msg = (f"the {desc} probes nprobe={nprobe} cells per query, above the faiss GPU limit of {max_select} "
                   f"(GPU_MAX_SELECTION_K: GpuIndexIVF throws above it)")
            if use_gpu:
                return GpuPlan(False, msg, desc, n_gpus=n, error=(
                    f"{msg}. Re-tune it on the GPU machine (gare-index tune: the tuner keeps nprobe <= {max_select} "
                    f"for GPU builds), or lower nprobe; or, {_GPU_OFF}. Clamping nprobe would serve a lower recall "
                    "than the index was tuned to"))
            return GpuPlan(False, msg, desc, n_gpus=n, warnings=(
                f"{msg}: searched on the CPU with nprobe={nprobe} (its tuned recall) instead of the GPU. Re-tune it "
                f"on the GPU machine to use the GPU",))
    if k_max is not None and k_max > max_select:
        warnings.append(f"searches for more than {max_select} results (up to {k_max} asked) exceed the faiss GPU "
                        f"limit: they are answered by the CPU copy of the {desc} (same results, CPU latency)")
    why = f"{type(inner).__name__} on {n} GPU(s)" + (
        ", coarse quantiser searched on the CPU (allowCpuCoarseQuantizer)" if opts.get("allowCpuCoarseQuantizer") else "")
    return GpuPlan(True, why, desc, n_gpus=n, cloner_options=opts, nprobe=nprobe, max_k=max_select,
                   warnings=tuple(warnings))


def _gpu_parts(index: faiss.Index) -> list[faiss.Index]:
    idx = faiss.downcast_index(index)
    if isinstance(idx, faiss.IndexIDMap) and idx.index is not None:
        return _gpu_parts(idx.index)
    if isinstance(idx, (faiss.IndexReplicas, faiss.IndexShards)):
        return [p for i in range(idx.count()) for p in _gpu_parts(idx.at(i))]
    return [idx]


def _to_gpu(cpu: faiss.Index, plan: GpuPlan) -> faiss.Index:
    """Clone ``cpu`` onto ``plan.n_gpus`` GPUs as ``plan`` says; GpuIndexError (naming the index and what to
    do) for anything that fails."""
    if not plan.on_gpu:
        raise GpuIndexError(f"the {plan.index} is not to be searched on the GPU: {plan.reason}")
    if not hasattr(faiss, "GpuMultipleClonerOptions"):
        raise GpuIndexError(f"the {plan.index} is planned for {plan.n_gpus} GPU(s), but this faiss "
                            f"({faiss.__version__}) is a CPU-only build: install faiss-gpu; or, {_GPU_OFF}")
    co = faiss.GpuMultipleClonerOptions()
    for name, value in plan.cloner_options.items():
        # fields a version lacks: use_cuvs (< 1.10), use_raft (>= 1.10: renamed), allowCpuCoarseQuantizer
        # (< 1.9, whose cloner copies a non-GPU coarse quantiser to the CPU by itself)
        if hasattr(co, name):
            setattr(co, name, value)
    try:
        gpu = faiss.index_cpu_to_all_gpus(cpu, co=co, ngpu=plan.n_gpus)
    except Exception as e:  # noqa: BLE001 - faiss raises RuntimeError with the C++ message
        raise GpuIndexError(f"cloning the {plan.index} to {plan.n_gpus} GPU(s) with {plan.cloner_options} "
                            f"failed: {e}; {_GPU_OFF}") from e
    if plan.nprobe is not None:
        _set_gpu_nprobe(gpu, plan)
    return gpu


def _set_gpu_nprobe(gpu: faiss.Index, plan: GpuPlan) -> None:
    """Set nprobe on every GPU IVF part explicitly (the cloner copies it; this makes it certain), and check it."""
    try:
        faiss.GpuParameterSpace().set_index_parameter(gpu, "nprobe", int(plan.nprobe))
    except Exception as e:  # noqa: BLE001
        raise GpuIndexError(f"setting nprobe={plan.nprobe} on the GPU copy of the {plan.index} failed: {e}; "
                            f"{_GPU_OFF}") from e
    for part in _gpu_parts(gpu):
        got = getattr(part, "nprobe", None)
        if got is not None and int(got) != int(plan.nprobe):
            raise GpuIndexError(f"the GPU copy of the {plan.index} has nprobe={got} after setting {plan.nprobe}")


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
    ``ivf`` index is returned cloned onto all GPUs as :func:`gpu_plan` says (GpuIndexError when
    ``use_gpu=True`` and it cannot be); :class:`AnnIndex` keeps and saves the CPU copy.  Otherwise the CPU
    index is returned.
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
    plan = gpu_plan(index, params, use_gpu=use_gpu)
    if plan.error:
        raise GpuIndexError(plan.error)
    for w in plan.warnings:
        log.warning("%s", w)
    if plan.on_gpu:
        return _to_gpu(index, plan)
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
        n_gpus: int | None = None,
        k_max: int | None = None,
    ) -> None:
        """``use_gpu`` (False / None = when possible / True = required) and ``n_gpus`` (None: ask faiss) go to
        :func:`gpu_plan`, as does ``k_max`` (the largest k callers ask; only for a warning).  A flat/ivf index
        planned for the GPU is cloned here, not at the first search: GpuIndexError now if it cannot be.  A GPU
        ``index`` (from :func:`build_index`) is kept as the GPU copy, with ``params``' nprobe set on it."""
        given_gpu = _is_gpu(index)
        self._cpu = _cpu_of(index)
        self.params = params if params is not None else AnnParams.from_index(self._cpu)
        _apply_search_params(self._cpu, self.params)
        self._store = _VectorStore(vectors, vector_ids)
        self._use_gpu = True if given_gpu else use_gpu
        self._n_gpus = n_gpus
        self._k_max = k_max
        self._gpu_lock = threading.Lock()  # faiss GPU indexes (their StandardGpuResources) are not thread-safe
        self._warned_k = False
        self._gpu: faiss.Index | None = None
        self._gpu_stale = False
        self._plan = self._make_plan()
        if self._plan.on_gpu:
            self._gpu = index if given_gpu else _to_gpu(self._cpu, self._plan)
            if given_gpu and self._plan.nprobe is not None:
                _set_gpu_nprobe(self._gpu, self._plan)
        log.debug("ANN %s: %s", "GPU" if self._gpu is not None else "CPU", self._plan.reason)

    def _make_plan(self) -> GpuPlan:
        plan = gpu_plan(self._cpu, self.params, use_gpu=self._use_gpu, n_gpus=self._n_gpus, k_max=self._k_max)
        if plan.error:
            raise GpuIndexError(plan.error)
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
    def gpu_plan(self) -> GpuPlan:
        """What :func:`gpu_plan` decided when this index was opened."""
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
                self._gpu = _to_gpu(self._cpu, self._plan)
                self._gpu_stale = False
            return self._gpu, True

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
        n_gpus: int | None = None,
        k_max: int | None = None,
    ) -> AnnIndex:
        """Read an index written by :meth:`save`.  ``params`` (default: recovered from the file) set the
        query-time knobs (nprobe, ef_search, rescore); its index_type must match the file.  ``use_gpu=None``
        moves flat/ivf to the GPU when faiss has one and :func:`gpu_plan` allows (``n_gpus``, ``k_max``: as
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
        n, d = _check_vectors(vectors, ids)
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
        inner = _inner(self._cpu)
        id_map = faiss.vector_to_array(outer.id_map).astype(np.int64)
        keep = ~np.isin(id_map, ids)
        removed = int((~keep).sum())
        if removed == 0:
            return 0
        xb = inner.reconstruct_n(0, inner.ntotal)
        self._cpu = build_index(xb[keep], id_map[keep], self.params, use_gpu=False)
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
