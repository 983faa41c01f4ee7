"""The folded psi's pair stage as one compiled CPU kernel: the checked views it reads (:class:`KernelArrays`),
the call that scores candidates (:func:`scores`, :func:`pair_scores`), its thread split and its warm-up.

`gare.psi_fold.pair_scores` in torch spends a K = 256 rerank on bookkeeping, not arithmetic: it gathers
the candidates' float16 frames (3 MB at f = 12, d = 512), upcasts them to a float32 copy (6 MB), multiplies,
and then runs ~40 small ops over (K, f) and (K, 5, f, f) tensors, each with its own dispatch and temporary.
The work itself is 3f dots of length d plus O(f²) per pair. This kernel does exactly that, pair by pair:
it reads each candidate's frames straight from the (memory-mapped) store, converts float16 to float32 in
registers, takes the three dots, and evaluates the closed form of the module docstring of
`gare.psi_fold` in scalars. Same formula, same float32 inputs, float32 accumulation: the scores equal the
torch path's to rounding (tests: 1e-5, and both against `gare.psi.pair_scores`).

numba compiles it on first use (seconds, in the first process: later ones load it from numba's on-disk cache;
the service does it in its lifespan, see `warm_up`), for float16 or float32 frames and constants. It releases
the GIL, so the service's threads run reranks side by side. CUDA tensors keep the torch path. The numba code
itself (the kernel, float16 as its uint16 bits widened exactly) is :mod:`gare.psi_fold_cpu_kernel`.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from gare.build_once import once

log = logging.getLogger(__name__)

_COS_EPS = 1e-8  # as gare.psi_fold._COS_EPS (F.cosine_similarity's eps) and gare.psi_fold_cpu_kernel.COS_EPS
# gare.psi_fold_videos.VEC_FIELDS / MAT_FIELDS, in that order (and gare.psi_fold_cpu_kernel.N_VEC / N_MAT)
_N_VEC, _N_MAT = 10, 5

_LOCK = threading.Lock()


_AVAILABLE: bool | None = None


def available() -> bool:
    """Whether numba imports here (a dependency of the package; without it the torch path runs, with one
    WARNING)."""
    global _AVAILABLE
    if _AVAILABLE is None:
        try:
            import numba  # noqa: F401

            _AVAILABLE = True
        except ImportError as e:  # pragma: no cover - numba is a dependency
            log.warning("numba is not importable (%s): the psi rerank uses torch ops, about 3x slower on the CPU", e)
            _AVAILABLE = False
    return _AVAILABLE


def _build() -> tuple[Any, Any]:
    from gare import psi_fold_cpu_kernel  # here, not at the top: it imports numba, which only a rerank needs

    return psi_fold_cpu_kernel.build()


_kernel = once(_build)  # the compiled kernel (gare.psi_fold_cpu_kernel), built on first use


def _ro(arr: np.ndarray) -> np.ndarray:
    """A read-only view: numba compiles one specialisation per writeable flag, and the index's memmaps are
    read-only, so every input goes in read-only and `warm_up` covers every layout a search meets."""
    v = arr.view()
    v.flags.writeable = False
    return v


def _as_kernel_array(x: Any, name: str, ndim: int, *, int8: bool = False) -> np.ndarray:
    """Read-only numpy view the kernel takes: float16 as its uint16 bits, float32 (and int8 where allowed) as
    is (memmaps are not copied: only the rows a search asks for are ever read)."""
    arr = np.asarray(x.detach().numpy() if hasattr(x, "detach") else x)
    if arr.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {arr.shape}")
    if arr.dtype == np.float16:
        arr = arr.view(np.uint16)
    elif arr.dtype != np.float32 and not (int8 and arr.dtype == np.int8):
        allowed = "float16 or float32 (or int8 with fscale)" if int8 else "float16 or float32"
        raise ValueError(f"{name} must be {allowed} for the CPU kernel, got {arr.dtype}")
    return _ro(np.ascontiguousarray(arr))


def _ro_f32(x: Any) -> np.ndarray:
    """x (numpy or a CPU tensor) as a read-only C-contiguous float32 array; one already so is used as is."""
    if isinstance(x, np.ndarray) and x.dtype == np.float32 and not x.flags.writeable and x.flags.c_contiguous:
        return x
    return _ro(np.ascontiguousarray(_f32_arg(x), dtype=np.float32))


def _f32_arg(x: Any) -> np.ndarray:
    return np.asarray(x.detach().cpu().numpy() if hasattr(x, "detach") else x)


# A thread's share of a rerank is at least this many pairs: below, handing work to another thread costs more
# than the pairs it takes (bench/results/rerank_floor.md times the stage at 1 to 4 threads).
MIN_PAIRS_PER_THREAD = 64
_POOL: ThreadPoolExecutor | None = None
_POOL_SIZE = 0


def _pool(workers: int) -> ThreadPoolExecutor:
    global _POOL, _POOL_SIZE
    with _LOCK:
        if _POOL is None or _POOL_SIZE < workers:
            if _POOL is not None:
                _POOL.shutdown(wait=False)
            _POOL, _POOL_SIZE = ThreadPoolExecutor(workers, thread_name_prefix="psi-rerank"), workers
        return _POOL


@dataclass(frozen=True)
class KernelArrays:
    """An index's arrays as the kernel reads them, checked once (`kernel_arrays`): read-only views, float16 as
    its uint16 bits; empty vr/vs/fs mean "none". A search keeps one per index version, so a request converts
    and checks nothing but its query vectors and candidate rows."""

    fr: np.ndarray  # (N, f, d) uint16 | float32 | int8
    fs: np.ndarray  # (N, f) float32 for int8 frames, else (0, 0)
    pk: np.ndarray  # (N, 10f + 5f² + 2) uint16 | float32
    vr: np.ndarray  # (N, d) float32 or (0, d)
    vs: np.ndarray  # (N,) float32 or (0,)


def kernel_arrays(frames: Any, packed: Any, *, vrows: Any = None, vscale: Any = None,
                  fscale: Any = None) -> KernelArrays:
    """The arguments of `pair_scores` (see there) checked and converted once (memmaps are not copied)."""
    fr = _as_kernel_array(frames, "frames", 3, int8=True)
    pk = _as_kernel_array(packed, "packed", 2)
    n, f, d = fr.shape
    if pk.shape[0] != n or pk.shape[1] != _N_VEC * f + _N_MAT * f * f + 2:
        raise ValueError(f"packed {pk.shape} does not match frames {fr.shape}")
    if fr.dtype == np.int8:
        fs = None if fscale is None else _f32_arg(fscale)
        if fs is None or fs.shape != (n, f) or fs.dtype != np.float32:
            raise ValueError(f"int8 frames need fscale float32 ({n}, {f}), got "
                             f"{None if fs is None else (fs.dtype, fs.shape)}")
    elif fscale is not None:
        raise ValueError(f"fscale goes with int8 frames only, got {fr.dtype} frames")
    else:
        fs = np.zeros((0, 0), np.float32)
    vr = np.zeros((0, d), np.float32) if vrows is None else _f32_arg(vrows)
    if vrows is not None and (vr.shape != (n, d) or vr.dtype != np.float32):
        raise ValueError(f"vrows must be float32 ({n}, {d}), got {vr.dtype} {vr.shape}")
    vs = np.zeros(0, np.float32) if vscale is None else _f32_arg(vscale)
    if vscale is not None and (vrows is None or vs.shape != (n,) or vs.dtype != np.float32):
        raise ValueError(f"vscale must be float32 ({n},) with vrows, got {vs.dtype} {vs.shape}")
    return KernelArrays(fr=fr, fs=_ro(np.ascontiguousarray(fs)), pk=pk, vr=_ro(np.ascontiguousarray(vr)),
                        vs=_ro(np.ascontiguousarray(vs)))


def pair_scores(q: Any, frames: Any, packed: Any, idx: Any, *, vrows: Any = None, vscale: Any = None,
                fscale: Any = None, threads: int = 1) -> np.ndarray:
    """Folded psi scores (a, K) float32 for the candidates idx (a, K) (rows into frames/packed, repeats allowed).

    q: `gare.psi_fold_queries.QueryVectors` (CPU); frames (N, f, d) and packed (N, 10f + 5f² + 2), float16 or
    float32, numpy (memmaps welcome: only the candidates' rows are read) or CPU tensors; frames may be int8
    with fscale (N, f) float32, frame g of row c being ``fscale[c, g] * frames[c, g]`` (an index's
    ``--frames-dtype int8``); vrows (N, d) float32 and vscale (N,) float32 give v̄ = vscale · vrows (the
    index's norm · unit; vscale None = 1), else v̄ is Σ ω_f F_f as the constants were folded. `threads` > 1
    splits the candidates over that many threads (the kernel releases the GIL), each taking at least
    MIN_PAIRS_PER_THREAD pairs. Equal to `gare.psi_fold.pair_scores` to float32 rounding."""
    return scores(q, kernel_arrays(frames, packed, vrows=vrows, vscale=vscale, fscale=fscale), idx, threads=threads)


def scores(q: Any, arrays: KernelArrays, idx: Any, *, threads: int = 1) -> np.ndarray:
    """`pair_scores` on arrays already checked by `kernel_arrays` (what the served rerank calls per request);
    q's u, sc and wsc may be numpy arrays (the served path) or CPU tensors (QueryVectors)."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    n, d = arrays.fr.shape[0], arrays.fr.shape[2]
    a = q.u.shape[0]
    ix = idx if isinstance(idx, np.ndarray) and idx.dtype == np.int64 and idx.flags.c_contiguous else \
        np.ascontiguousarray(np.asarray(idx, dtype=np.int64))
    if ix.ndim != 2 or ix.shape[0] != a:
        raise ValueError(f"idx must be ({a}, K) candidate rows, got {ix.shape}")
    if ix.size and (int(ix.min()) < 0 or int(ix.max()) >= n):
        raise ValueError(f"candidate rows must lie in [0, {n}), got [{int(ix.min())}, {int(ix.max())}]")
    u, sc, wsc = (_ro_f32(x) for x in (q.u, q.sc, q.wsc))
    if u.shape[1:] != (3, d):
        raise ValueError(f"query vectors {u.shape} do not match frames of width {d}")
    out = np.empty(ix.shape, np.float32)
    eps = q.eps if isinstance(q.eps, np.ndarray) and not q.eps.flags.writeable else _ro(np.asarray(q.eps, np.float64))
    args = (u, sc, wsc, eps, np.float32(q.inv_temp), arrays.fr, arrays.fs, arrays.pk, arrays.vr, arrays.vs, _ro(ix))
    kernel = _kernel()[0]
    k = ix.shape[1]
    parts = max(1, min(threads, (a * k) // MIN_PAIRS_PER_THREAD))
    if parts == 1:
        kernel(*args, 0, k, out)
        return out
    # every thread scores a contiguous run of every query's candidates into its own columns of `out`
    cuts = [k * p // parts for p in range(parts + 1)]
    futs = [_pool(parts - 1).submit(kernel, *args, cuts[p], cuts[p + 1], out) for p in range(1, parts)]
    kernel(*args, cuts[0], cuts[1], out)
    for fu in futs:
        fu.result()
    return out


def widen_half(x: np.ndarray) -> np.ndarray:
    """float16 (n, m) -> float32 (n, m) by the kernel's own conversion (what the tests hold to numpy's)."""
    x = np.ascontiguousarray(x, dtype=np.float16)
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D, got shape {x.shape}")
    out = np.empty(x.shape, np.float32)
    _kernel()[1](x.view(np.uint16), out)
    return out


def warm_up() -> float:
    """Compile the kernel for the index's layouts (float16, float32 or int8 frames, float32 or float16
    constants, with and without v̄ rows) so no request pays for it; seconds spent."""
    from types import SimpleNamespace

    import torch

    t0 = time.perf_counter()
    f, d = 2, 4
    # the fields of gare.psi_fold_queries.QueryVectors the kernel reads (this module imports nothing of the project)
    q = SimpleNamespace(u=torch.zeros(1, 3, d), sc=torch.zeros(1, 7), wsc=torch.zeros(4), eps=(1e-5, 1e-5, 1e-5),
                        inv_temp=1.0)
    w = _N_VEC * f + _N_MAT * f * f + 2
    for fdt in (np.float16, np.float32, np.int8):
        fs = np.ones((1, f), np.float32) if fdt == np.int8 else None
        for pdt in (np.float32, np.float16):
            fr, pk = np.ones((1, f, d), fdt), np.ones((1, w), pdt)
            pair_scores(q, fr, pk, np.zeros((1, 1), np.int64), fscale=fs)
            pair_scores(q, fr, pk, np.zeros((1, 1), np.int64), vrows=np.ones((1, d), np.float32),
                        vscale=np.ones(1, np.float32), fscale=fs)
    dt = time.perf_counter() - t0
    log.info("psi fold CPU kernel compiled in %.1f s", dt)
    return dt
