"""Where an ANN index is searched: the GPU placement plan (:func:`gpu_plan`), the clone to the GPU(s) and its errors.

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
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import faiss

from gare_index.ann_params import AnnParams, cpu_of, default_nprobe, inner_index

__all__ = ["GPU_MAX_K", "GpuPlan", "GpuIndexError", "gpu_plan", "to_gpu", "num_gpus", "gpu_available",
           "coarse_accelerator"]

# faiss GPU k-selection limit: GPU_MAX_SELECTION_K (faiss/gpu/utils/DeviceDefs.cuh) is 2048 for every CUDA build
# from faiss 1.8 to 1.15 (1024 only for CUDA <= 9.0); GpuIndex::search (validateKSelect) and GpuIndexIVF
# (validateNProbe, at copyFrom and at every search) throw above it.  cuVS builds allow 16384, but gpu_plan turns
# cuVS off.  Both nprobe (cells selected per query) and k (results) are bounded by it.
GPU_MAX_K = 2048

log = logging.getLogger(__name__)


def num_gpus() -> int:
    """GPUs faiss can use (0 for a faiss-cpu build)."""
    try:
        return int(faiss.get_num_gpus())
    except AttributeError:  # pragma: no cover - very old builds
        return 0


def gpu_available(use_gpu: bool | None) -> bool:
    if use_gpu is False:
        return False
    n = num_gpus()
    if use_gpu and n == 0:
        raise GpuIndexError("use_gpu=True but faiss sees no GPU (install faiss-gpu and check CUDA)")
    return n > 0


def coarse_accelerator(d: int, use_gpu: bool | None) -> faiss.Index | None:
    """An empty flat inner-product index (d) on the GPU(s), to assign rows to IVF cells while an index is built
    (k-means training and adding); None without a GPU or with ``use_gpu=False`` (the CPU quantiser does it)."""
    if not gpu_available(use_gpu):
        return None
    try:
        return faiss.index_cpu_to_all_gpus(faiss.IndexFlatIP(d))
    except Exception as e:  # noqa: BLE001 - faiss raises RuntimeError with the C++ message
        if use_gpu:
            raise GpuIndexError(f"a GPU flat index (d={d}) for IVF training could not be made: {e}; {GPU_OFF}") from e
        log.warning("IVF training on the CPU: a GPU flat index (d=%d) could not be made: %s", d, e)
        return None


GPU_OFF = "to search it on the CPU instead, set use_gpu_ann: false (GARE_USE_GPU_ANN=false; use_gpu=False in Python)"


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
    # GpuMultipleClonerOptions fields to set (those the installed faiss has; see to_gpu)
    cloner_options: dict[str, bool] = field(default_factory=dict)
    nprobe: int | None = None  # ivf: nprobe set on the GPU copy (<= max_k)
    max_k: int = GPU_MAX_K  # largest k (results per query) the GPU copy answers; larger k search the CPU copy
    error: str | None = None  # opening must fail with this message (use_gpu=True and the GPU cannot run it)
    warnings: tuple[str, ...] = ()  # logged at WARNING when the index is opened


def nprobe_of(inner: faiss.Index, params: AnnParams | None) -> int:
    """The nprobe ``apply_search_params`` gives an IVF index under ``params`` (the index's own without)."""
    if params is None:
        return int(inner.nprobe)
    return int(min(inner.nlist, params.nprobe or default_nprobe(inner.nlist)))


def describe_index(inner: faiss.Index, params: AnnParams | None = None) -> str:
    if params is not None:
        t = params.index_type
    elif isinstance(inner, faiss.IndexIVF):
        t = "ivfpq" if isinstance(inner, (faiss.IndexIVFPQ, faiss.IndexIVFPQFastScan)) else "ivf"
    else:
        t = "hnsw" if isinstance(inner, faiss.IndexHNSW) else "flat" if isinstance(inner, faiss.IndexFlat) else "?"
    s = f"{t} index ({type(inner).__name__}, {int(inner.ntotal)} vectors of d={int(inner.d)}"
    if isinstance(inner, faiss.IndexIVF):
        q = faiss.downcast_index(inner.quantizer)
        s += f", nlist={int(inner.nlist)}, nprobe={nprobe_of(inner, params)}, coarse quantiser {type(q).__name__}"
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
    ``apply_search_params`` sets it), or the index's own when ``params`` is None.
    """
    max_select = GPU_MAX_K if max_select is None else int(max_select)
    inner = inner_index(cpu_of(index))
    desc = describe_index(inner, params)
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
    n = num_gpus() if n_gpus is None else int(n_gpus)
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
        nprobe = nprobe_of(inner, params)
        if nprobe > max_select:
            msg = (f"the {desc} probes nprobe={nprobe} cells per query, above the faiss GPU limit of {max_select} "
                   f"(GPU_MAX_SELECTION_K: GpuIndexIVF throws above it)")
            if use_gpu:
                return GpuPlan(False, msg, desc, n_gpus=n, error=(
                    f"{msg}. Re-tune it on the GPU machine (gare-index tune: the tuner keeps nprobe <= {max_select} "
                    f"for GPU builds), or lower nprobe; or, {GPU_OFF}. Clamping nprobe would serve a lower recall "
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


def gpu_parts(index: faiss.Index) -> list[faiss.Index]:
    idx = faiss.downcast_index(index)
    if isinstance(idx, faiss.IndexIDMap) and idx.index is not None:
        return gpu_parts(idx.index)
    if isinstance(idx, (faiss.IndexReplicas, faiss.IndexShards)):
        return [p for i in range(idx.count()) for p in gpu_parts(idx.at(i))]
    return [idx]


def to_gpu(cpu: faiss.Index, plan: GpuPlan) -> faiss.Index:
    """Clone ``cpu`` onto ``plan.n_gpus`` GPUs as ``plan`` says; GpuIndexError (naming the index and what to
    do) for anything that fails."""
    if not plan.on_gpu:
        raise GpuIndexError(f"the {plan.index} is not to be searched on the GPU: {plan.reason}")
    if not hasattr(faiss, "GpuMultipleClonerOptions"):
        raise GpuIndexError(f"the {plan.index} is planned for {plan.n_gpus} GPU(s), but this faiss "
                            f"({faiss.__version__}) is a CPU-only build: install faiss-gpu; or, {GPU_OFF}")
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
                            f"failed: {e}; {GPU_OFF}") from e
    if plan.nprobe is not None:
        set_gpu_nprobe(gpu, plan)
    return gpu


def set_gpu_nprobe(gpu: faiss.Index, plan: GpuPlan) -> None:
    """Set nprobe on every GPU IVF part explicitly (the cloner copies it; this makes it certain), and check it."""
    try:
        faiss.GpuParameterSpace().set_index_parameter(gpu, "nprobe", int(plan.nprobe))
    except Exception as e:  # noqa: BLE001
        raise GpuIndexError(f"setting nprobe={plan.nprobe} on the GPU copy of the {plan.index} failed: {e}; "
                            f"{GPU_OFF}") from e
    for part in gpu_parts(gpu):
        got = getattr(part, "nprobe", None)
        if got is not None and int(got) != int(plan.nprobe):
            raise GpuIndexError(f"the GPU copy of the {plan.index} has nprobe={got} after setting {plan.nprobe}")
