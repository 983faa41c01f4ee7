"""Stage 2 of the search: psi scores of the stage-1 candidates, by the fold (the one served implementation).

psi is folded exactly into per-video constants (stored in the index, :mod:`gare_index.psi_consts`) and
per-query vectors (:mod:`gare.psi_fold`): ~3f + 1 dot products per pair plus O(f²) work, equal to
``model.score`` to float32 rounding (the tests check it against the model and a fused reference to 1e-5).
On the CPU one compiled kernel (:mod:`gare.psi_fold_cpu`, numba) reads each candidate's rows straight from the
memory-mapped arrays; elsewhere (CUDA) the candidates of a whole batch are read once (unique rows) and share
their constants in torch ops.

An index version without valid constants (written before them, or folded for other psi weights) is served
with constants folded in memory when it is first used (:func:`prepare`, at load in the service), with one
WARNING naming ``gare-index upgrade`` (:func:`gare_index.psi_consts.served`).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from gare import psi_fold as pf
from gare import psi_fold_cpu, psi_fold_cpu_queries
from gare.psi_fold_queries import QueryFoldCache, fold_arrays, fold_queries
from gare_index import psi_consts

log = logging.getLogger(__name__)

# The query side of the fold per query embedding: a query seen again (the service's query cache returns the
# same t) skips its (d, 2d + 3) product. 4,096 queries x 6 KB at d = 512: ~25 MB at most.
QUERY_FOLDS = QueryFoldCache(4096)


_ARRAYS_LOCK = threading.Lock()
RERANK_THREADS: int | None = None  # None: the torch intra-op threads (see rerank_threads)
# Where the psi rerank runs when the model is on a GPU: "model" (there: the candidates' rows are gathered from the
# memory-mapped arrays and copied over, ~4 MB for K = 256) or "cpu" (the compiled CPU kernel reads them in place;
# only t's 2 KB cross). gare-serve and its Ray shard replicas set it from GARE_RERANK_DEVICE; bench/gpu_bench.py measures both. On a CPU
# model both are the CPU kernel.
RERANK_DEVICES = ("model", "cpu")
RERANK_DEVICE = "model"
_CPU_FOLDS: dict[str, Any] = {}  # psi fingerprint -> the fold's CPU copy, for RERANK_DEVICE "cpu" over several queries


def rerank_threads() -> int:
    """Threads one rerank may use: RERANK_THREADS when set, else the torch intra-op threads this process was
    given (gare-serve sets usable cores // workers, so a worker spreads its rerank only over cores no other
    worker was given)."""
    return max(1, RERANK_THREADS or torch.get_num_threads())


def fold_usable(model: Any, version: Any) -> bool:
    """Whether `version` stores psi constants valid for model.psi (else the search folds them in memory)."""
    return psi_consts.fold_status(version, psi_consts.fold_of(model)) is None


def prepare(model: Any, version: Any) -> None:
    """Get `version` ready for the rerank: fold its constants in memory now (one WARNING) when it stores no
    valid ones, so that no request pays for it."""
    psi_consts.served(model, version)


def warm_up(device: torch.device | str) -> None:
    """Compile the CPU kernels of the rerank and its query fold (a few seconds, once per process) when `device` will use it, so
    that no request pays for it."""
    if (torch.device(device).type == "cpu" or RERANK_DEVICE == "cpu") and psi_fold_cpu.available():
        psi_fold_cpu.warm_up()
        psi_fold_cpu_queries.warm_up()


def kernel_reads(version: Any, consts: np.ndarray) -> bool:
    """Whether the CPU kernel can read this version's arrays as stored (float16/float32 frames, or int8 frames
    with their per-frame scales; float16/float32 constants, float32 units and norms) and numba is importable."""
    ok = (np.float16, np.float32)
    fr = version.frames.q if getattr(version, "frame_scales", None) is not None else version.frames
    return ((fr.dtype in ok or fr.dtype == np.int8) and consts.dtype in ok and version.units.dtype == np.float32
            and np.asarray(version.norms).dtype == np.float32 and psi_fold_cpu.available())


# id(version) -> (weak reference to it, the arrays it was made from, their kernel views or None when the kernel
# cannot read them): the kernel's checks and views of an index's arrays once per version, not per request
_ARRAYS: dict[int, tuple[Any, tuple[Any, ...], psi_fold_cpu.KernelArrays | None]] = {}
_ARRAYS_MAX = 16


def _kernel_arrays(version: Any, consts: np.ndarray) -> psi_fold_cpu.KernelArrays | None:
    """The version's arrays as the CPU kernel reads them (kept per version while it and its arrays live), or
    None when the kernel cannot read them (see :func:`kernel_reads`)."""
    fscale = getattr(version, "frame_scales", None)  # int8 frames: the kernel scales frame g of row c by fscale[c, g]
    src = (version.frames, consts, version.units, version.norms, fscale)
    got = _ARRAYS.get(id(version))
    if got is not None and got[0]() is version and all(a is b for a, b in zip(got[1], src, strict=True)):
        return got[2]
    ka = None
    if kernel_reads(version, consts):
        ka = psi_fold_cpu.kernel_arrays(version.frames if fscale is None else version.frames.q, consts,
                                        vrows=version.units, vscale=version.norms, fscale=fscale)
    try:
        ref = weakref.ref(version)
    except TypeError:  # an object without weak references (tests' stand-ins): not kept
        return ka
    key = id(version)
    with _ARRAYS_LOCK:
        while len(_ARRAYS) >= _ARRAYS_MAX:
            _ARRAYS.pop(next(iter(_ARRAYS)))
        _ARRAYS[key] = (ref, src, ka)
    weakref.finalize(version, _ARRAYS.pop, key, None)  # the views hold the memmaps: dropped with the version
    return ka


def padded(ids: np.ndarray, sizes: list[int]) -> np.ndarray:
    """Flat per-query ids (the queries' runs of `sizes`) -> (len(sizes), max K) int64, each row padded with its
    first id (a valid row; the pads' scores are dropped by :func:`unpad`)."""
    if len(sizes) == 1:  # one query (the common request): no padding, no copy
        return np.asarray(ids, dtype=np.int64).reshape(1, -1)
    out = np.zeros((len(sizes), max(sizes, default=0)), dtype=np.int64)
    offs = np.cumsum([0] + sizes)
    for i, (a, b) in enumerate(zip(offs[:-1], offs[1:], strict=True)):
        out[i, : b - a] = ids[a:b]
        out[i, b - a :] = ids[a] if b > a else 0
    return out


def unpad(s: np.ndarray, sizes: list[int]) -> np.ndarray:
    """(queries, max K) scores -> the flat scores of the real candidates (inverse of :func:`padded`)."""
    return np.concatenate([s[i, :k] for i, k in enumerate(sizes)]) if len(sizes) > 1 else s[0, : sizes[0]].copy()


def psi_scores(model: Any, version: Any, t: torch.Tensor, cand_ids: np.ndarray | Sequence[np.ndarray]) -> list[np.ndarray]:
    """psi scores s_tj for each query's candidates: t (a, d); cand_ids[i] (K_i,) valid ids -> list of (K_i,)."""
    if len(cand_ids) == 1:  # one query (the common request): no offsets, no concatenation
        c = np.asarray(cand_ids[0], dtype=np.int64).reshape(-1)
        if c.size == 0:
            return [np.zeros(0, np.float32)]
        return [_fold_pairs(model, version, t, version.rows(c), [c.size])]
    lists = [np.asarray(c, dtype=np.int64).reshape(-1) for c in cand_ids]
    sizes = [c.size for c in lists]
    offs = np.cumsum([0] + sizes)
    if offs[-1] == 0:
        return [np.zeros(0, np.float32) for _ in lists]
    rows = version.rows(lists[0] if len(lists) == 1 else np.concatenate(lists))
    flat = _fold_pairs(model, version, t, rows, sizes)
    return [flat[a:b] for a, b in zip(offs[:-1], offs[1:], strict=True)]


def _row_f32(t: torch.Tensor) -> np.ndarray:
    """t (1, d) on the CPU -> its row as float32 numpy (d,), a view when t is float32 (one tensor call: with the
    caches cold after stage 1, each torch call costs ~20-70 us on the 2-core VM, numpy's ~5)."""
    try:
        row = t.detach().numpy()[0]
    except TypeError:  # bfloat16 and other dtypes numpy lacks
        row = t.detach().to(torch.float32).numpy()[0]
    return row if row.dtype == np.float32 else row.astype(np.float32)


def _fold_pairs(model: Any, version: Any, t: torch.Tensor, rows: np.ndarray, sizes: list[int]) -> np.ndarray:
    """Folded psi for the pairs (query i, rows of its candidates), flat in the callers' order.

    On the CPU the compiled kernel reads each candidate's rows straight from the memory-mapped arrays; one query
    (the common request) goes from t to the scores through numpy arrays only, no tensor op between (each costs
    ~20-70 us on a cold cache). Elsewhere the batch's candidate rows are read once, ascending (memmap friendly),
    into one VideoConstants that every query shares; each query's candidates are ids into it. Either way K is
    padded to the batch's largest."""
    fold = psi_consts.fold_of(model)
    if t.device.type != "cpu" and RERANK_DEVICE == "cpu" and psi_fold_cpu.available():
        t = t.detach().to("cpu", torch.float32)  # (a, d): the kernel reads the candidates where they are stored
        if len(sizes) > 1:
            fold = _cpu_fold(fold)
    dev = t.device
    # the stored constants when valid (fold_of once per request: its check is ~4 us), else served()
    if psi_consts.fold_status(version, fold) is None:
        consts = version.psi_consts
    else:
        with torch.inference_mode():
            consts = psi_consts.served(model, version)
    ka = _kernel_arrays(version, consts) if dev.type == "cpu" else None
    if ka is not None and len(sizes) == 1:
        temp = model.cfg.temp
        u, sc = QUERY_FOLDS.fold_one(_row_f32(t), fold, temp)
        fa = fold_arrays(fold)
        qa = SimpleNamespace(u=u, sc=sc, wsc=fa.scalars, eps=fa.eps, inv_temp=1.0 / float(temp))
        return psi_fold_cpu.scores(qa, ka, rows.reshape(1, -1), threads=rerank_threads())[0]
    with torch.inference_mode():
        q = QUERY_FOLDS.fold(t, fold, model.cfg.temp)
        if ka is not None:
            s = psi_fold_cpu.scores(q, ka, padded(rows, sizes), threads=rerank_threads())
            return unpad(s, sizes)
        uniq, inv = np.unique(rows, return_inverse=True)
        v = psi_consts.gather(version, uniq, fold, dev, consts=consts)
        s = pf.pair_scores(q, v, torch.from_numpy(padded(inv.reshape(-1), sizes)).to(dev)).cpu().numpy()
    return unpad(s, sizes)


def _cpu_fold(fold: Any) -> Any:
    """fold's CPU copy (made once per psi fingerprint, a few MB): the batched query fold for RERANK_DEVICE "cpu"."""
    with _ARRAYS_LOCK:
        got = _CPU_FOLDS.get(fold.fingerprint)
        if got is None:
            got = _CPU_FOLDS[fold.fingerprint] = fold.to("cpu")
            while len(_CPU_FOLDS) > 4:
                _CPU_FOLDS.pop(next(iter(_CPU_FOLDS)))
    return got


def exhaustive_psi(model: Any, version: Any, t: torch.Tensor, *, block: int = 8192, progress: bool = False) -> np.ndarray:
    """psi scores of every gallery entry for each query (a, n), block by block (coverage, benchmarks, compare).

    The index's stored constants when valid, else the fold computed block by block (one log line): a whole
    gallery is one large product per block."""
    n = version.n
    out = np.empty((t.shape[0], n), dtype=np.float32)
    dev = t.device
    fold = psi_consts.fold_of(model)
    why = psi_consts.fold_status(version, fold)
    if why is not None:
        log.info("exhaustive psi: %s; folding the constants block by block instead", why)
    q = fold_queries(t, fold, model.cfg.temp)
    starts = tqdm(range(0, n, block), desc="exhaustive psi (fold)", unit="block", disable=not progress)
    with torch.inference_mode():
        for s0 in starts:
            v = psi_consts.block(version, s0, min(n, s0 + block), fold, dev, stored=why is None,
                                 reference_padding=psi_consts.reference_padding(model))
            out[:, s0 : s0 + v.n] = pf.exhaustive(q, v, device=dev).numpy()
    return out


def rerank_shortlists(model: Any, version: Any, t: torch.Tensor, ids: Sequence[np.ndarray],
                      opts: Sequence[Any]) -> list[np.ndarray | None]:
    """psi scores of every query's shortlist in one pass, None for a query whose options turn the rerank off:
    t (a, d) float32, ids[i] query i's candidate ids."""
    psi: list[np.ndarray | None] = [None] * len(opts)
    need = [i for i, o in enumerate(opts) if o.rerank]
    if need:
        tn = t if len(need) == len(opts) else t[need]  # every query reranked (the common case): no gather
        for i, s in zip(need, psi_scores(model, version, tn, [ids[i] for i in need]), strict=True):
            psi[i] = s
    return psi
