"""One rerank's candidates as the psi pair stage reads them: :func:`candidate_constants` gathers, in one call,
everything the fold needs to score the candidates of a batch of queries against an index version.

On the CPU (when the compiled kernel can read the version's arrays: :func:`kernel_reads`) that is the version's
arrays as the kernel reads them (:class:`gare.psi_fold_cpu.KernelArrays`, checked once per version and kept while
the version lives) and the candidates' row numbers: the kernel reads each candidate's rows in place from the
memory-mapped store. Elsewhere (CUDA, or a layout the kernel cannot read) it is the batch's candidate rows read
once, ascending (memmap friendly), as one :class:`gare.psi_fold_videos.VideoConstants` on the device, and each
query's candidates as positions in it. Either way the constants are the stored ones when they are valid for the
model's psi, else the ones folded in memory for the version (:func:`gare_index.psi_consts.served`).

A :class:`gare_index.resident_version.ResidentVersion` (the version copied onto the device) gives the same
VideoConstants by index_select on its device tensors: no host array is read and no candidate row crosses from
the host (only the candidates' row numbers do).
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from gare import psi_fold_cpu
from gare.model_protocols import PsiModel
from gare.psi_fold_videos import VideoConstants
from gare.psi_fold_weights import PsiFold
from gare_index import psi_consts
from gare_index.frame_quant import QuantFrames
from gare_index.resident import ResidentIndex
from gare_index.resident_version import ResidentVersion
from gare_index.version_protocol import PsiVersion

log = logging.getLogger(__name__)

_LOCK = threading.Lock()


@dataclass(frozen=True)
class CandidateConstants:
    """What the psi pair stage needs for one batch's candidates (see :func:`candidate_constants`)."""

    fold: PsiFold  # psi's folded weights, on the device the queries are folded on
    temp: float  # the model's pooling temperature (the query side of the fold)
    idx: np.ndarray  # (a, K) int64: query i's candidates, padded to the batch's largest K with its first one
    kernel: psi_fold_cpu.KernelArrays | None  # the CPU kernel's views of the whole version; idx are rows of it
    videos: VideoConstants | None  # otherwise the batch's unique candidate rows on the device; idx index them


def kernel_reads(version: PsiVersion, consts: np.ndarray) -> bool:
    """Whether the CPU kernel can read this version's arrays as stored (float16/float32 frames, or int8 frames
    with their per-frame scales; float16/float32 constants, float32 units and norms) and numba is importable."""
    ok = (np.float16, np.float32)
    fr = version.frames.q if isinstance(version.frames, QuantFrames) else version.frames
    return ((fr.dtype in ok or fr.dtype == np.int8) and consts.dtype in ok and version.units.dtype == np.float32
            and np.asarray(version.norms).dtype == np.float32 and psi_fold_cpu.available())


# id(version) -> (weak reference to it, the arrays it was made from, their kernel views or None when the kernel
# cannot read them): the kernel's checks and views of an index's arrays once per version, not per request
_ARRAYS: dict[int, tuple[weakref.ref[PsiVersion], tuple[object, ...], psi_fold_cpu.KernelArrays | None]] = {}
_ARRAYS_MAX = 16


def _kernel_arrays(version: PsiVersion, consts: np.ndarray) -> psi_fold_cpu.KernelArrays | None:
    """The version's arrays as the CPU kernel reads them (kept per version while it and its arrays live), or
    None when the kernel cannot read them (see :func:`kernel_reads`)."""
    frames = version.frames
    # int8 frames: the kernel reads the int8 values and scales frame g of row c by fscale[c, g]
    fq, fscale = (frames.q, frames.scales) if isinstance(frames, QuantFrames) else (frames, None)
    src = (frames, consts, version.units, version.norms, fscale)
    got = _ARRAYS.get(id(version))
    if got is not None and got[0]() is version and all(a is b for a, b in zip(got[1], src, strict=True)):
        return got[2]
    ka = None
    if kernel_reads(version, consts):
        ka = psi_fold_cpu.kernel_arrays(fq, consts, vrows=version.units, vscale=version.norms, fscale=fscale)
    try:
        ref = weakref.ref(version)
    except TypeError:  # an object without weak references (tests' stand-ins): not kept
        return ka
    key = id(version)
    with _LOCK:
        while len(_ARRAYS) >= _ARRAYS_MAX:
            _ARRAYS.pop(next(iter(_ARRAYS)))
        _ARRAYS[key] = (ref, src, ka)
    weakref.finalize(version, _ARRAYS.pop, key, None)  # the views hold the memmaps: dropped with the version
    return ka


_CPU_FOLDS: dict[str, PsiFold] = {}  # psi fingerprint -> the fold's CPU copy (a GPU model reranked on the CPU)


def _cpu_fold(fold: PsiFold) -> PsiFold:
    """fold's CPU copy, made once per psi fingerprint (a few MB), for queries folded on the CPU while the model
    is elsewhere (the same values: a copy is exact)."""
    with _LOCK:
        got = _CPU_FOLDS.get(fold.fingerprint)
        if got is None:
            got = _CPU_FOLDS[fold.fingerprint] = fold.to("cpu")
            while len(_CPU_FOLDS) > 4:
                _CPU_FOLDS.pop(next(iter(_CPU_FOLDS)))
    return got


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


_RESIDENT_WARNED: set[tuple[str, str]] = set()  # (version name, psi fingerprint) warned about once


def _resident_serves(resident: ResidentIndex, fold: PsiFold, device: torch.device) -> bool:
    """Whether a rerank on `device` with psi `fold` reads `resident`: its constants are `fold`'s, and the rerank
    runs where the copy lives (a CUDA rerank on a CUDA copy; the CPU only for a CPU copy: a GPU-resident index
    reranked on the CPU keeps the compiled kernel over the memory maps, what RerankSettings.device="cpu" asks)."""
    if resident.fingerprint != fold.fingerprint:
        key = (resident.name, fold.fingerprint)
        if key not in _RESIDENT_WARNED:
            _RESIDENT_WARNED.add(key)
            log.warning("index version %s: its resident copy holds psi constants %s, the model's psi is %s; "
                        "reranking from the host arrays (logged once)", resident.name, resident.fingerprint[:12],
                        fold.fingerprint[:12])
        return False
    return bool(resident.devices) and device.type == resident.devices[0].type


def candidate_constants(model: PsiModel, version: PsiVersion, rows: np.ndarray, sizes: list[int],
                        device: torch.device) -> CandidateConstants:
    """Everything the psi pair stage needs to score the candidates `rows` (flat (Σ K_i,) row numbers, query i's
    run of sizes[i]) on `device`: the fold, the temperature and, on the CPU when the kernel can read the
    version, the kernel's views with the rows themselves (read in place); elsewhere the unique rows' constants
    on `device` with each candidate's position among them. Padded to the batch's largest K (:func:`padded`)."""
    fold = psi_consts.fold_of(model)
    if isinstance(version, ResidentVersion):
        if _resident_serves(version.resident, fold, device):
            # the candidates' rows by index_select on the device copy: no host array is read
            uniq, inv = np.unique(rows, return_inverse=True)
            with torch.inference_mode():
                videos = version.resident.gather(uniq, device)
            qfold = _cpu_fold(fold) if device.type == "cpu" and fold.device.type != "cpu" else fold
            return CandidateConstants(fold=qfold, temp=model.cfg.temp, idx=padded(inv.reshape(-1), sizes),
                                      kernel=None, videos=videos)
        version = version.wrapped  # the host path over the memory-mapped version (its caches are per version)
    # the stored constants when valid (the check costs less than any gather), else those folded in memory
    if psi_consts.fold_status(version, fold) is None:
        consts = version.psi_consts
        assert consts is not None  # fold_status checked it
    else:
        with torch.inference_mode():
            consts = psi_consts.served(model, version)
    qfold = _cpu_fold(fold) if device.type == "cpu" and fold.device.type != "cpu" else fold
    ka = _kernel_arrays(version, consts) if device.type == "cpu" else None
    if ka is not None:
        return CandidateConstants(fold=qfold, temp=model.cfg.temp, idx=padded(rows, sizes), kernel=ka, videos=None)
    uniq, inv = np.unique(rows, return_inverse=True)
    with torch.inference_mode():
        videos = psi_consts.gather(version, uniq, fold, device, consts=consts)
    return CandidateConstants(fold=qfold, temp=model.cfg.temp, idx=padded(inv.reshape(-1), sizes), kernel=None,
                              videos=videos)
