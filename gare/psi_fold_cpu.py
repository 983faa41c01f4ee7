"""The folded psi's pair stage as one compiled CPU kernel (issue 12).

`gare.psi_fold.pair_scores` in torch spends a K = 256 rerank on bookkeeping, not arithmetic: it gathers
the candidates' float16 frames (3 MB at f = 12, d = 512), upcasts them to a float32 copy (6 MB), multiplies,
and then runs ~40 small ops over (K, f) and (K, 5, f, f) tensors, each with its own dispatch and temporary.
The work itself is 3f dots of length d plus O(f²) per pair. This kernel does exactly that, pair by pair:
it reads each candidate's frames straight from the (memory-mapped) store, converts float16 to float32 in
registers, takes the three dots, and evaluates the closed form of the module docstring of
`gare.psi_fold` in scalars. Same formula, same float32 inputs, float32 accumulation: the scores equal the
torch path's to rounding (tests: 1e-5, and both against `gare.psi.pair_scores`).

numba compiles it on first use (a few seconds, once per process: the service does it in its lifespan, see
`warm_up`), for float16 or float32 frames and constants. It releases the GIL, so the service's threads run
reranks side by side. CUDA tensors keep the torch path.

numba has no float16 type on the CPU, so float16 arrays come in viewed as uint16 and are widened with the
exact bit construction: for a half h, the float32 with bits ``(h & 0x7fff) << 13 | (h & 0x8000) << 16``
times 2^112 is h, for normal and subnormal halves alike; inf and NaN halves get the float32 exponent 255.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

_COS_EPS = 1e-8  # as gare.psi_fold._COS_EPS (F.cosine_similarity's eps)
_N_VEC, _N_MAT = 10, 5  # gare.psi_fold_videos.VEC_FIELDS / MAT_FIELDS, in that order

_KERNEL: Any = None
_LOCK = threading.Lock()


def _build() -> Any:
    import numba
    from numba import types
    from numba.extending import overload

    def widen(src, dst):  # pragma: no cover - replaced by the overload below
        raise NotImplementedError

    @overload(widen, inline="always")
    def _widen(src, dst):
        if src.dtype == types.uint16:  # float16 bits
            def impl(src, dst):
                bits = dst.view(np.uint32)
                for k in range(src.shape[0]):  # branch-free, so LLVM vectorises it
                    h = np.uint32(src[k])
                    mag = (h & np.uint32(0x7FFF)) << np.uint32(13)
                    # exponent 31 (inf, NaN) -> float32 exponent 255; the x 2^112 below keeps inf inf and NaN NaN
                    special = ((h & np.uint32(0x7C00)) + np.uint32(0x0400)) >> np.uint32(15)  # 1 iff exponent 31
                    mag |= special * np.uint32(0x7F800000)
                    bits[k] = mag | ((h & np.uint32(0x8000)) << np.uint32(16))
                for k in range(src.shape[0]):
                    dst[k] *= np.float32(2.0**112)
            return impl

        def impl(src, dst):  # float32 (or any float): a plain copy
            for k in range(src.shape[0]):
                dst[k] = np.float32(src[k])
        return impl

    # reassociation lets LLVM vectorise the dot products; no other fast-math flag (the softmax needs -inf)
    @numba.njit(fastmath={"reassoc", "contract"}, nogil=True, cache=False, boundscheck=False)
    def dots3(x, u, out):
        a0 = np.float32(0.0)
        a1 = np.float32(0.0)
        a2 = np.float32(0.0)
        for k in range(x.shape[0]):
            a0 += x[k] * u[0, k]
            a1 += x[k] * u[1, k]
            a2 += x[k] * u[2, k]
        out[0] = a0
        out[1] = a1
        out[2] = a2

    @numba.njit(fastmath={"reassoc", "contract"}, nogil=True, cache=False, boundscheck=False)
    def dot(x, y):
        a = np.float32(0.0)
        for k in range(x.shape[0]):
            a += x[k] * np.float32(y[k])
        return a

    @numba.njit(nogil=True, cache=False, boundscheck=False)
    def kernel(u, sc, wsc, eps, inv_temp, frames, packed, vrows, vscale, idx, out):
        """u (a, 3, d) f32; sc (a, 7) f32; wsc (4,) f32; eps (3,) f64; frames (N, f, d) uint16|f32;
        packed (N, W) uint16|f32; vrows (N, d) f32 or (0, d): v̄ = vscale[c] * vrows[c] (vscale (N,) or (0,):
        all ones); without vrows, v̄·t = Σ ω_f t·F_f; idx (a, K) int64 rows; out (a, K) f32."""
        a, K = idx.shape
        f, d = frames.shape[1], frames.shape[2]
        W = packed.shape[1]
        fd = np.float32(d)
        sqd = np.float32(math.sqrt(d))
        eps1, eps2, eps3 = np.float32(eps[0]), np.float32(eps[1]), np.float32(eps[2])
        cz0, m00, m01, m11 = wsc[0], wsc[1], wsc[2], wsc[3]
        x = np.empty(d, np.float32)
        pk = np.empty(W, np.float32)
        dd3 = np.empty(3, np.float32)
        dt = np.empty(f, np.float32)
        d1 = np.empty(f, np.float32)
        d2 = np.empty(f, np.float32)
        aw = np.empty(f, np.float32)
        ww = np.empty(f, np.float32)
        ninf = np.float32(-np.inf)
        for i in range(a):
            tt, ctt, tsum, tk2, tm0, tm1 = sc[i, 0], sc[i, 1], sc[i, 2], sc[i, 3], sc[i, 4], sc[i, 5]
            ui = u[i]
            for j in range(K):
                c = idx[i, j]
                widen(packed[c], pk)
                for g in range(f):
                    widen(frames[c, g], x)
                    dots3(x, ui, dd3)
                    dt[g] = dd3[0]
                    d1[g] = dd3[1]
                    d2[g] = dd3[2]
                # packed row: rs, bias, le, lg, omega, g2, mu0, mu1, pi0, pi1 (f each); G1, G2, G3, P, H (f x f); cvv, vsum
                if vrows.shape[0] > 0:
                    vt = dot(vrows[c], ui[0]) * (vscale[c] if vscale.shape[0] > 0 else np.float32(1.0))
                else:
                    vt = np.float32(0.0)
                    for g in range(f):
                        vt += pk[4 * f + g] * dt[g]
                cvv, vsum = pk[W - 2], pk[W - 1]
                vct = vt - vsum * tsum / fd
                s1 = np.float32(math.sqrt(max(cvv - np.float32(2.0) * vct + ctt, np.float32(0.0)) / fd + eps1))
                # attention logits (psi attends where ω_f > 0) and pooling logits, softmaxed in place
                ma, mw = ninf, ninf
                for g in range(f):
                    la = (pk[2 * f + g] - d1[g] * pk[g] / sqd) / s1 + pk[3 * f + g]
                    aw[g] = la if pk[4 * f + g] > 0 else ninf
                    ww[g] = dt[g] * inv_temp + pk[f + g]
                    ma = max(ma, aw[g])
                    mw = max(mw, ww[g])
                za, zw = np.float32(0.0), np.float32(0.0)
                for g in range(f):
                    aw[g] = np.float32(math.exp(aw[g] - ma))
                    ww[g] = np.float32(math.exp(ww[g] - mw))
                    za += aw[g]
                    zw += ww[g]
                for g in range(f):
                    aw[g] /= za
                    ww[g] /= zw
                # quadratic forms aᵀG1a, aᵀG2a, aᵀG3a, wᵀHw; (aᵀP)_g; linear forms a·g2, a·μ0, a·μ1; Σ a_f u2·F_f/σ_f
                m0 = _N_VEC * f
                q1, q2, q3, q5 = np.float32(0.0), np.float32(0.0), np.float32(0.0), np.float32(0.0)
                l0, l1, l2, ad2 = np.float32(0.0), np.float32(0.0), np.float32(0.0), np.float32(0.0)
                for r in range(f):
                    ar, wr = aw[r], ww[r]
                    b1, b2, b3, b5 = np.float32(0.0), np.float32(0.0), np.float32(0.0), np.float32(0.0)
                    for g in range(f):
                        o = r * f + g
                        b1 += pk[m0 + o] * aw[g]
                        b2 += pk[m0 + f * f + o] * aw[g]
                        b3 += pk[m0 + 2 * f * f + o] * aw[g]
                        b5 += pk[m0 + 4 * f * f + o] * ww[g]
                    q1 += ar * b1
                    q2 += ar * b2
                    q3 += ar * b3
                    q5 += wr * b5
                    l0 += pk[5 * f + r] * ar
                    l1 += pk[6 * f + r] * ar
                    l2 += pk[7 * f + r] * ar
                    ad2 += ar * d2[r] * pk[r]
                s2 = np.float32(math.sqrt(max(q1, np.float32(0.0)) / fd + eps2))
                s3 = np.float32(math.sqrt(max(q2 / (s2 * s2) + np.float32(2.0) * l0 / s2 + cz0, np.float32(0.0)) / fd + eps3))
                t_delta = ((ad2 + tk2) / s2 + tm0) / s3 + tm1
                ddl = (q3 / (s2 * s2) + np.float32(2.0) * l1 / s2 + m00) / (s3 * s3) + np.float32(2.0) * (l2 / s2 + m01) / s3 + m11
                tdp = np.float32(0.0)
                for g in range(f):
                    ap = np.float32(0.0)  # (aᵀP)_g
                    for r in range(f):
                        ap += aw[r] * pk[m0 + 3 * f * f + r * f + g]
                    tdp += ww[g] * (dt[g] + (ap / s2 + pk[8 * f + g]) / s3 + pk[9 * f + g])
                nx = np.float32(math.sqrt(max(tt + np.float32(2.0) * t_delta + ddl, np.float32(0.0))))
                npp = np.float32(math.sqrt(max(q5, np.float32(0.0))))
                out[i, j] = tdp / (max(nx, np.float32(_COS_EPS)) * max(npp, np.float32(_COS_EPS)))

    @numba.njit(nogil=True, cache=False)
    def widen_rows(src, dst):
        for r in range(src.shape[0]):
            widen(src[r], dst[r])

    return kernel, widen_rows


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


def _kernel() -> Any:
    global _KERNEL
    if _KERNEL is None:
        with _LOCK:
            if _KERNEL is None:
                _KERNEL = _build()
    return _KERNEL


def _ro(arr: np.ndarray) -> np.ndarray:
    """A read-only view: numba compiles one specialisation per writeable flag, and the index's memmaps are
    read-only, so every input goes in read-only and `warm_up` covers every layout a search meets."""
    v = arr.view()
    v.flags.writeable = False
    return v


def _as_kernel_array(x: Any, name: str, ndim: int) -> np.ndarray:
    """Read-only numpy view the kernel takes: float16 as its uint16 bits, float32 as is (memmaps are not
    copied: only the rows a search asks for are ever read)."""
    arr = np.asarray(x.detach().numpy() if hasattr(x, "detach") else x)
    if arr.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {arr.shape}")
    if arr.dtype == np.float16:
        arr = arr.view(np.uint16)
    elif arr.dtype != np.float32:
        raise ValueError(f"{name} must be float16 or float32 for the CPU kernel, got {arr.dtype}")
    return _ro(np.ascontiguousarray(arr))


def pair_scores(q: Any, frames: Any, packed: Any, idx: Any, *, vrows: Any = None, vscale: Any = None) -> np.ndarray:
    """Folded psi scores (a, K) float32 for the candidates idx (a, K) (rows into frames/packed, repeats allowed).

    q: `gare.psi_fold_queries.QueryVectors` (CPU); frames (N, f, d) and packed (N, 10f + 5f² + 2), float16 or
    float32, numpy (memmaps welcome: only the candidates' rows are read) or CPU tensors; vrows (N, d) float32
    and vscale (N,) float32 give v̄ = vscale · vrows (the index's norm · unit; vscale None = 1), else v̄ is
    Σ ω_f F_f as the constants were folded. Equal to `gare.psi_fold.pair_scores` to float32 rounding."""
    fr = _as_kernel_array(frames, "frames", 3)
    pk = _as_kernel_array(packed, "packed", 2)
    n, f, d = fr.shape
    if pk.shape[0] != n or pk.shape[1] != _N_VEC * f + _N_MAT * f * f + 2:
        raise ValueError(f"packed {pk.shape} does not match frames {fr.shape}")
    a = q.u.shape[0]
    ix = _ro(np.ascontiguousarray(np.asarray(idx, dtype=np.int64)))
    if ix.ndim != 2 or ix.shape[0] != a:
        raise ValueError(f"idx must be ({a}, K) candidate rows, got {ix.shape}")
    if ix.size and (int(ix.min()) < 0 or int(ix.max()) >= n):
        raise ValueError(f"candidate rows must lie in [0, {n}), got [{int(ix.min())}, {int(ix.max())}]")
    vr = np.zeros((0, d), np.float32) if vrows is None else np.asarray(vrows.detach().numpy() if hasattr(vrows, "detach") else vrows)
    if vrows is not None and (vr.shape != (n, d) or vr.dtype != np.float32):
        raise ValueError(f"vrows must be float32 ({n}, {d}), got {vr.dtype} {vr.shape}")
    vs = np.zeros(0, np.float32) if vscale is None else np.asarray(vscale.detach().numpy() if hasattr(vscale, "detach") else vscale)
    if vscale is not None and (vrows is None or vs.shape != (n,) or vs.dtype != np.float32):
        raise ValueError(f"vscale must be float32 ({n},) with vrows, got {vs.dtype} {vs.shape}")
    u, sc, wsc = (_ro(np.ascontiguousarray(x.detach().cpu().numpy(), dtype=np.float32)) for x in (q.u, q.sc, q.wsc))
    if u.shape[1:] != (3, d):
        raise ValueError(f"query vectors {u.shape} do not match frames of width {d}")
    out = np.empty(ix.shape, np.float32)
    _kernel()[0](u, sc, wsc, _ro(np.asarray(q.eps, np.float64)), np.float32(q.inv_temp), fr, pk,
                 _ro(np.ascontiguousarray(vr)), _ro(np.ascontiguousarray(vs)), ix, out)
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
    """Compile the kernel for the index's layouts (float16 frames, float32 or float16 constants, with and
    without v̄ rows) so no request pays for it; seconds spent."""
    from types import SimpleNamespace

    import torch

    t0 = time.perf_counter()
    f, d = 2, 4
    # the fields of gare.psi_fold_queries.QueryVectors the kernel reads (this module imports nothing of the project)
    q = SimpleNamespace(u=torch.zeros(1, 3, d), sc=torch.zeros(1, 7), wsc=torch.zeros(4), eps=(1e-5, 1e-5, 1e-5),
                        inv_temp=1.0)
    w = _N_VEC * f + _N_MAT * f * f + 2
    for fdt in (np.float16, np.float32):
        for pdt in (np.float32, np.float16):
            fr, pk = np.ones((1, f, d), fdt), np.ones((1, w), pdt)
            pair_scores(q, fr, pk, np.zeros((1, 1), np.int64))
            pair_scores(q, fr, pk, np.zeros((1, 1), np.int64), vrows=np.ones((1, d), np.float32),
                        vscale=np.ones(1, np.float32))
    dt = time.perf_counter() - t0
    log.info("psi fold CPU kernel compiled in %.1f s", dt)
    return dt
