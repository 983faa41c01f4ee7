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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from gare.build_once import once

log = logging.getLogger(__name__)

_COS_EPS = 1e-8  # as gare.psi_fold._COS_EPS (F.cosine_similarity's eps)
_N_VEC, _N_MAT = 10, 5  # gare.psi_fold_videos.VEC_FIELDS / MAT_FIELDS, in that order

_LOCK = threading.Lock()


def _has_f16c() -> bool:
    """Whether LLVM can widen float16 with one instruction here (x86 F16C's vcvtph2ps; AArch64 always can)."""
    import platform

    from llvmlite import binding

    if platform.machine().lower() in ("aarch64", "arm64"):
        return True
    try:
        return bool(binding.get_host_cpu_features().get("f16c", False))
    except RuntimeError:  # pragma: no cover - llvmlite could not read the features
        return False


def _build() -> Any:
    import numba
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic, overload

    f16c = _has_f16c()

    @intrinsic
    def h2f(typingctx, h):
        """float16 bits (uint16) -> float32 by LLVM's fpext: one vcvtph2ps per 8-16 lanes once vectorised."""
        if h != types.uint16:
            return None

        def codegen(context, builder, signature, args):
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
        return types.float32(types.uint16), codegen

    @intrinsic
    def u32_as_f32(typingctx, b):
        """The float32 whose bits are b (uint32)."""
        if b != types.uint32:
            return None

        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.FloatType())
        return types.float32(types.uint32), codegen

    @intrinsic
    def prefetch(typingctx, arr, c, off):
        """Hint the cache to fetch byte `off` of row c of arr (C-contiguous rows): LLVM's prefetch, read, L1."""
        if not isinstance(arr, types.Array) or not isinstance(c, types.Integer) or not isinstance(off, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            ary = context.make_array(signature.args[0])(context, builder, args[0])
            i64 = ir.IntType(64)
            stride = builder.extract_value(ary.strides, 0)
            byte = builder.add(builder.mul(context.cast(builder, args[1], signature.args[1], types.intp), stride),
                               context.cast(builder, args[2], signature.args[2], types.intp))
            addr = builder.add(builder.ptrtoint(ary.data, i64), byte)
            ptr = ir.IntType(8).as_pointer()
            i32 = ir.IntType(32)
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [ptr, i32, i32, i32]),
                                                "llvm.prefetch.p0")
            builder.call(fn, [builder.inttoptr(addr, ptr), i32(0), i32(3), i32(1)])
            return context.get_dummy_value()
        return types.void(arr, c, off), codegen

    @numba.njit(inline="always", nogil=True, boundscheck=False)
    def prefetch_row(arr, c, nbytes):
        for o in range(0, nbytes, 64):  # every cache line of the row's nbytes, its last byte included
            prefetch(arr, c, o)
        prefetch(arr, c, nbytes - 1)

    def as_f32(x):  # pragma: no cover - replaced by the overload below
        raise NotImplementedError

    @overload(as_f32, inline="always")
    def _as_f32(x):
        if x == types.uint16 and f16c:
            return lambda x: h2f(x)
        if x == types.uint16:  # no F16C: the exact bit construction of the module docstring
            def impl(x):
                h = np.uint32(x)
                mag = (h & np.uint32(0x7FFF)) << np.uint32(13)
                special = ((h & np.uint32(0x7C00)) + np.uint32(0x0400)) >> np.uint32(15)  # 1 iff exponent 31
                mag |= special * np.uint32(0x7F800000)
                return u32_as_f32(mag | ((h & np.uint32(0x8000)) << np.uint32(16))) * np.float32(2.0**112)
            return impl
        return lambda x: np.float32(x)  # float32 as is, int8 (quantized frames) exactly

    def const_row(packed, c, buf):  # pragma: no cover - replaced by the overload below
        raise NotImplementedError

    @overload(const_row, inline="always")
    def _const_row(packed, c, buf):
        if packed.dtype == types.float32:
            return lambda packed, c, buf: packed[c]  # read in place from the (memory-mapped) store
        def impl(packed, c, buf):  # float16 constants: widened once per candidate (842 values at f = 12)
            row = packed[c]
            for k in range(row.shape[0]):
                buf[k] = as_f32(row[k])
            return buf
        return impl

    # reassociation lets LLVM vectorise the dot products; no other fast-math flag (the softmax needs -inf)
    fm = {"reassoc", "contract"}

    @numba.njit(fastmath=fm, nogil=True, cache=False, boundscheck=False)
    def dot(x, y):
        a = np.float32(0.0)
        for k in range(x.shape[0]):
            a += x[k] * np.float32(y[k])
        return a

    # error_model numpy: a division by zero gives inf/NaN as torch does, and no test per division
    @numba.njit(fastmath=fm, nogil=True, cache=False, boundscheck=False, error_model="numpy")
    def kernel(u, sc, wsc, eps, inv_temp, frames, fscale, packed, vrows, vscale, idx, j0, j1, out):
        """u (a, 3, d) f32; sc (a, 7) f32; wsc (4,) f32; eps (3,) f64; frames (N, f, d) uint16|f32|int8 with
        fscale (N, f) f32 for int8 (frame g of row c is fscale[c, g] * frames[c, g]) or (0, 0); packed (N, W)
        uint16|f32; vrows (N, d) f32 or (0, d): v̄ = vscale[c] * vrows[c] (vscale (N,) or (0,): all ones);
        without vrows, v̄·t = Σ ω_f t·F_f; idx (a, K) int64 rows; the candidates j0 <= j < j1 of every query
        are scored into out (a, K) f32 (a thread's share)."""
        a = idx.shape[0]
        f, d = frames.shape[1], frames.shape[2]
        W = packed.shape[1]
        fd = np.float32(d)
        sqd = np.float32(math.sqrt(d))
        eps1, eps2, eps3 = np.float32(eps[0]), np.float32(eps[1]), np.float32(eps[2])
        cz0, m00, m01, m11 = wsc[0], wsc[1], wsc[2], wsc[3]
        buf = np.empty(W, np.float32)
        dt = np.empty(f, np.float32)
        d1 = np.empty(f, np.float32)
        d2 = np.empty(f, np.float32)
        aw = np.empty(f, np.float32)
        ww = np.empty(f, np.float32)
        oaa, oaw, oww = np.empty(f * f, np.float32), np.empty(f * f, np.float32), np.empty(f * f, np.float32)
        ninf = np.float32(-np.inf)
        z = np.float32(0.0)
        tiny = np.float32(np.finfo(np.float32).tiny)
        scaled = fscale.shape[0] > 0
        for i in range(a):
            tt, ctt, tsum, tk2, tm0, tm1 = sc[i, 0], sc[i, 1], sc[i, 2], sc[i, 3], sc[i, 4], sc[i, 5]
            for j in range(j0, j1):
                c = idx[i, j]
                # the next candidate's rows (frames, constants, v̄ row: ~17 KB at f = 12, d = 512) are requested
                # now, so their fetch from memory overlaps this candidate's arithmetic: the rows lie anywhere in
                # the store, and without the hint each row's first lines wait on memory (~25% of a cold rerank)
                if j + 1 < j1:
                    cn = idx[i, j + 1]
                    prefetch_row(frames, cn, f * d * frames.itemsize)
                    prefetch_row(packed, cn, W * packed.itemsize)
                    if vrows.shape[0] > 0:
                        prefetch_row(vrows, cn, d * 4)
                pk = const_row(packed, c, buf)
                # the 3 dots of each frame, widened in registers (no float32 copy of the frames), four frames per
                # pass over u so each load of u feeds 4 FMAs (one frame per pass: the loads of u, not the FMAs,
                # bounded the loop); written out here, not called: a call per frame costs more than its work
                for g0 in range(0, f, 4):
                    nb = min(4, f - g0)
                    g1, g2, g3 = g0 + min(1, nb - 1), g0 + min(2, nb - 1), g0 + min(3, nb - 1)  # repeats past f
                    x00, x01, x02, x10, x11, x12 = z, z, z, z, z, z
                    x20, x21, x22, x30, x31, x32 = z, z, z, z, z, z
                    for k in range(d):
                        ua, ub, uc = u[i, 0, k], u[i, 1, k], u[i, 2, k]
                        y0, y1 = as_f32(frames[c, g0, k]), as_f32(frames[c, g1, k])
                        y2, y3 = as_f32(frames[c, g2, k]), as_f32(frames[c, g3, k])
                        x00 += y0 * ua
                        x01 += y0 * ub
                        x02 += y0 * uc
                        x10 += y1 * ua
                        x11 += y1 * ub
                        x12 += y1 * uc
                        x20 += y2 * ua
                        x21 += y2 * ub
                        x22 += y2 * uc
                        x30 += y3 * ua
                        x31 += y3 * ub
                        x32 += y3 * uc
                    for gg, (e0, e1, e2) in enumerate(((x00, x01, x02), (x10, x11, x12), (x20, x21, x22), (x30, x31, x32))):
                        if gg < nb:
                            g = g0 + gg
                            sg = fscale[c, g] if scaled else np.float32(1.0)  # int8: the dots of q·s are s x those of q
                            dt[g], d1[g], d2[g] = e0 * sg, e1 * sg, e2 * sg
                # packed row: rs, bias, le, lg, omega, g2, mu0, mu1, pi0, pi1 (f each); G1, G2, G3, P, H (f x f); cvv, vsum
                if vrows.shape[0] > 0:
                    vt = dot(vrows[c], u[i, 0]) * (vscale[c] if vscale.shape[0] > 0 else np.float32(1.0))
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
                    # a weight below float32's smallest normal is flushed to 0 (a change of < 1e-38 in a sum
                    # of 1): subnormal operands in the f x f forms below cost ~100 cycles each (microcode
                    # assists), which at a pooling temperature of 0.01 made the rerank several times slower
                    ea = np.float32(math.exp(aw[g] - ma))
                    ew = np.float32(math.exp(ww[g] - mw))
                    aw[g] = np.float32(0.0) if ea < tiny else ea  # NaN (a video with no frame) stays NaN
                    ww[g] = np.float32(0.0) if ew < tiny else ew
                    za += aw[g]
                    zw += ww[g]
                for g in range(f):
                    aw[g] /= za
                    ww[g] /= zw
                # quadratic forms aᵀG1a, aᵀG2a, aᵀG3a, aᵀPw, wᵀHw as flat dots of the f x f matrices with the outer
                # products a⊗a, a⊗w, w⊗w: one vectorised pass over the 5f² constants and one horizontal sum per form
                # (per row r and form, a sum of f terms cost a horizontal sum each: ~40% of the hot kernel)
                ff, m0 = f * f, _N_VEC * f
                for r in range(f):
                    for g in range(f):
                        oaa[r * f + g] = aw[r] * aw[g]
                        oaw[r * f + g] = aw[r] * ww[g]
                        oww[r * f + g] = ww[r] * ww[g]
                q1, q2, q3, q4, q5 = z, z, z, z, z
                for o in range(ff):
                    q1 += pk[m0 + o] * oaa[o]
                    q2 += pk[m0 + ff + o] * oaa[o]
                    q3 += pk[m0 + 2 * ff + o] * oaa[o]
                    q4 += pk[m0 + 3 * ff + o] * oaw[o]
                    q5 += pk[m0 + 4 * ff + o] * oww[o]
                # linear forms a·g2, a·μ0, a·μ1, Σ a_f u2·F_f/σ_f, w·(t·F + π1), w·π0
                l0, l1, l2, ad2, w1, w0 = z, z, z, z, z, z
                for r in range(f):
                    ar = aw[r]
                    l0 += pk[5 * f + r] * ar
                    l1 += pk[6 * f + r] * ar
                    l2 += pk[7 * f + r] * ar
                    ad2 += ar * d2[r] * pk[r]
                    w1 += ww[r] * (dt[r] + pk[9 * f + r])
                    w0 += ww[r] * pk[8 * f + r]
                s2 = np.float32(math.sqrt(max(q1, z) / fd + eps2))
                s3 = np.float32(math.sqrt(max(q2 / (s2 * s2) + np.float32(2.0) * l0 / s2 + cz0, z) / fd + eps3))
                t_delta = ((ad2 + tk2) / s2 + tm0) / s3 + tm1
                ddl = (q3 / (s2 * s2) + np.float32(2.0) * l1 / s2 + m00) / (s3 * s3) + np.float32(2.0) * (l2 / s2 + m01) / s3 + m11
                # Σ_g w_g (t·F_g + ((aᵀP)_g / s2 + π0_g) / s3 + π1_g), the sums over g taken term by term
                tdp = w1 + (q4 / s2 + w0) / s3
                nx = np.float32(math.sqrt(max(tt + np.float32(2.0) * t_delta + ddl, np.float32(0.0))))
                npp = np.float32(math.sqrt(max(q5, np.float32(0.0))))
                out[i, j] = tdp / (max(nx, np.float32(_COS_EPS)) * max(npp, np.float32(_COS_EPS)))

    @numba.njit(nogil=True, cache=False)
    def widen_rows(src, dst):
        for r in range(src.shape[0]):
            row, o = src[r], dst[r]
            for k in range(row.shape[0]):
                o[k] = as_f32(row[k])

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


_kernel = once(_build)  # the compiled kernel, built on first use


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


# A thread's share of a rerank is at least this many pairs: below, handing work to another thread (~20-50 µs)
# costs more than it saves (a pair is ~1 µs at f = 12, d = 512).
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
