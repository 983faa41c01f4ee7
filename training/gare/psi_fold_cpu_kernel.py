"""The numba code of the folded psi's CPU path: the kernel that scores candidates pair by pair (what
:mod:`gare.psi_fold_cpu` calls), the float16 widening it uses and the query side's fold (`fold_rows`, what
:mod:`gare.psi_fold_cpu_queries` calls).

Built in named pieces: the LLVM intrinsics (`h2f`: float16 -> float32, `u32_as_f32`: a bit cast, `prefetch`),
the readers of the stored rows (`as_f32`: a frame value as float32, `const_row`: a row of constants,
`prefetch_row`: a row's prefetch) and the kernels (`kernel`, `widen_rows`, `fold_rows`). The pair kernel's loop
body is one function on purpose, its six stages labelled in place (the frame dots, v̄·t, the two softmaxes, the
quadratic forms, the linear forms, the cosine): the stages share registers and the frame loop is unrolled by
hand, and a call per stage or per frame costs more than its work.

Every piece is defined at module level so that numba caches the compiled kernels on disk (``cache=True``): a
process after the first loads them instead of compiling them, which was most of a CPU process's start. numba
keys a cached kernel by this file's content (any edit here recompiles), the argument types and the CPU (its
name and every feature flag, so code built for one CPU is never loaded on another), and keeps it in
``NUMBA_CACHE_DIR`` when set, else in ``__pycache__`` beside this file, else (not writable, as in a read-only
install) in the user's cache directory; with no writable place at all the kernels compile in memory as before.
Every value the kernels read is defined in this file, so the content key covers it. This module imports numba,
so the package imports it only on first use (:func:`build`, from the first rerank or ``warm_up``).

numba has no float16 type on the CPU, so float16 arrays come in viewed as uint16 and are widened either by one
F16C instruction (LLVM's fpext) or, without F16C, by the exact bit construction: for a half h, the float32 with
bits ``(h & 0x7fff) << 13 | (h & 0x8000) << 16`` times 2^112 is h, for normal and subnormal halves alike; inf and
NaN halves get the float32 exponent 255. Which of the two is fixed per process (`F16C`); a cached kernel is only
loaded on a CPU with the same features, so with the same choice.

The closed form each pair evaluates is derived in the module docstring of :mod:`gare.psi_fold`; the names here
(dt, d1, d2, s1..s3, q1..q5) follow it.
"""

from __future__ import annotations

import logging
import math
import platform
from collections.abc import Callable
from typing import Any

import numba
import numpy as np
from llvmlite import binding, ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

log = logging.getLogger(__name__)

COS_EPS = 1e-8  # as gare.psi_fold._COS_EPS (F.cosine_similarity's eps)
N_VEC, N_MAT = 10, 5  # gare.psi_fold_videos.VEC_FIELDS / MAT_FIELDS, in that order
# reassociation lets LLVM vectorise the dot products; no other fast-math flag (the softmax needs -inf)
FASTMATH = {"reassoc", "contract"}


def has_f16c() -> bool:
    """Whether LLVM can widen float16 with one instruction here (x86 F16C's vcvtph2ps; AArch64 always can)."""
    if platform.machine().lower() in ("aarch64", "arm64"):
        return True
    try:
        return bool(binding.get_host_cpu_features().get("f16c", False))
    except RuntimeError:  # pragma: no cover - llvmlite could not read the features
        return False


# the reader `as_f32` uses for float16, fixed when this module is imported; the on-disk cache is keyed by the
# CPU's feature flags (f16c among them), so a kernel loaded from it was compiled with this same choice
F16C = has_f16c()


def cached_jit(**options: Any) -> Callable[[Any], Any]:
    """numba.njit(**options) with the on-disk cache; without any writable cache directory (numba finds none at
    decoration), the function compiles in memory as before, with one WARNING."""
    def wrap(fn: Any) -> Any:
        try:
            return numba.njit(cache=True, **options)(fn)
        except RuntimeError as e:  # numba: "cannot cache function ...: no locator available"
            log.warning("numba cannot cache %s (%s): it compiles in every process", fn.__name__, e)
            return numba.njit(cache=False, **options)(fn)
    return wrap


# ------------------------------------------------------------------------------------------------------------
# the LLVM-level helpers numba has no word for
# ------------------------------------------------------------------------------------------------------------


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


# ------------------------------------------------------------------------------------------------------------
# how the kernel reads the stored rows: as_f32 (one stored value -> float32: float16 bits widened, int8 and
# float32 exact), const_row (row c of the constants as float32 (W,): in place when float32, else widened into
# buf) and prefetch_row (every cache line of row c's first nbytes)
# ------------------------------------------------------------------------------------------------------------


@numba.njit(inline="always", nogil=True, boundscheck=False)
def prefetch_row(arr, c, nbytes):
    for o in range(0, nbytes, 64):  # every cache line of the row's nbytes, its last byte included
        prefetch(arr, c, o)
    prefetch(arr, c, nbytes - 1)


def as_f32(x):  # pragma: no cover - replaced by the overload below
    raise NotImplementedError


@overload(as_f32, inline="always")
def _as_f32(x):
    if x == types.uint16 and F16C:
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


# ------------------------------------------------------------------------------------------------------------
# the pair stage's kernel: every candidate of every query scored in one compiled loop (see its docstring)
# ------------------------------------------------------------------------------------------------------------


@cached_jit(fastmath=FASTMATH, nogil=True, boundscheck=False)
def dot(x, y):
    a = np.float32(0.0)
    for k in range(x.shape[0]):
        a += x[k] * np.float32(y[k])
    return a


# error_model numpy: a division by zero gives inf/NaN as torch does, and no test per division
@cached_jit(fastmath=FASTMATH, nogil=True, boundscheck=False, error_model="numpy")
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
    dt = np.empty(f, np.float32)  # (f,) t·F_g
    d1 = np.empty(f, np.float32)  # (f,) u1·F_g
    d2 = np.empty(f, np.float32)  # (f,) u2·F_g
    aw = np.empty(f, np.float32)  # (f,) attention weights a
    ww = np.empty(f, np.float32)  # (f,) pooling weights w
    oaa, oaw, oww = np.empty(f * f, np.float32), np.empty(f * f, np.float32), np.empty(f * f, np.float32)
    ninf = np.float32(-np.inf)
    z = np.float32(0.0)
    tiny = np.float32(np.finfo(np.float32).tiny)
    scaled = fscale.shape[0] > 0
    for i in range(a):
        tt, ctt, tsum, tk2, tm0, tm1 = sc[i, 0], sc[i, 1], sc[i, 2], sc[i, 3], sc[i, 4], sc[i, 5]
        for j in range(j0, j1):
            c = idx[i, j]
            # the next candidate's rows (frames, constants, v̄ row) are requested now, so their fetch from
            # memory overlaps this candidate's arithmetic: the rows lie anywhere in the store, and without the
            # hint each row's first cache lines wait on memory
            if j + 1 < j1:
                cn = idx[i, j + 1]
                prefetch_row(frames, cn, f * d * frames.itemsize)
                prefetch_row(packed, cn, W * packed.itemsize)
                if vrows.shape[0] > 0:
                    prefetch_row(vrows, cn, d * 4)
            pk = const_row(packed, c, buf)  # (W,) float32
            # stage 1, the frame dots dt, d1, d2 (f,): the 3 dots of each frame, widened in registers (no
            # float32 copy of the frames), four frames per pass over u so each load of u feeds 4 FMAs (one
            # frame per pass: the loads of u, not the FMAs, bounded the loop); written out here, not called:
            # a call per frame costs more than its work
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
            # stage 2, v̄·t and the gap's scale s1. packed row: rs, bias, le, lg, omega, g2, mu0, mu1, pi0, pi1
            # (f each); G1, G2, G3, P, H (f x f); cvv, vsum
            if vrows.shape[0] > 0:
                vt = dot(vrows[c], u[i, 0]) * (vscale[c] if vscale.shape[0] > 0 else np.float32(1.0))
            else:
                vt = np.float32(0.0)
                for g in range(f):
                    vt += pk[4 * f + g] * dt[g]
            cvv, vsum = pk[W - 2], pk[W - 1]
            vct = vt - vsum * tsum / fd
            s1 = np.float32(math.sqrt(max(cvv - np.float32(2.0) * vct + ctt, np.float32(0.0)) / fd + eps1))
            # stage 3, the weights aw, ww (f,): attention logits (psi attends where ω_f > 0) and pooling
            # logits, softmaxed in place
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
            # stage 4, the quadratic forms aᵀG1a, aᵀG2a, aᵀG3a, aᵀPw, wᵀHw as flat dots of the f x f matrices
            # with the outer products a⊗a, a⊗w, w⊗w (f², each): one vectorised pass over the 5f² constants and
            # one horizontal sum per form (a horizontal sum per row r and form was most of the hot kernel)
            ff, m0 = f * f, N_VEC * f
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
            # stage 5, the linear forms a·g2, a·μ0, a·μ1, Σ a_f u2·F_f/σ_f, w·(t·F + π1), w·π0
            l0, l1, l2, ad2, w1, w0 = z, z, z, z, z, z
            for r in range(f):
                ar = aw[r]
                l0 += pk[5 * f + r] * ar
                l1 += pk[6 * f + r] * ar
                l2 += pk[7 * f + r] * ar
                ad2 += ar * d2[r] * pk[r]
                w1 += ww[r] * (dt[r] + pk[9 * f + r])
                w0 += ww[r] * pk[8 * f + r]
            # stage 6, the cosine of t + Δ and the pooled frames: the scales s2, s3, then the norms
            s2 = np.float32(math.sqrt(max(q1, z) / fd + eps2))
            s3 = np.float32(math.sqrt(max(q2 / (s2 * s2) + np.float32(2.0) * l0 / s2 + cz0, z) / fd + eps3))
            t_delta = ((ad2 + tk2) / s2 + tm0) / s3 + tm1
            ddl = (q3 / (s2 * s2) + np.float32(2.0) * l1 / s2 + m00) / (s3 * s3) + np.float32(2.0) * (l2 / s2 + m01) / s3 + m11
            # Σ_g w_g (t·F_g + ((aᵀP)_g / s2 + π0_g) / s3 + π1_g), the sums over g taken term by term
            tdp = w1 + (q4 / s2 + w0) / s3
            nx = np.float32(math.sqrt(max(tt + np.float32(2.0) * t_delta + ddl, np.float32(0.0))))
            npp = np.float32(math.sqrt(max(q5, np.float32(0.0))))
            out[i, j] = tdp / (max(nx, np.float32(COS_EPS)) * max(npp, np.float32(COS_EPS)))


@cached_jit(nogil=True)
def widen_rows(src, dst):
    """widen_rows(src (n, m) uint16 float16 bits, dst (n, m) float32): the kernel's own float16 conversion."""
    for r in range(src.shape[0]):
        row, o = src[r], dst[r]
        for k in range(row.shape[0]):
            o[k] = as_f32(row[k])


# ------------------------------------------------------------------------------------------------------------
# the query side of the fold (gare.psi_fold_cpu_queries.fold_query_rows)
# ------------------------------------------------------------------------------------------------------------


# FASTMATH as the rerank's kernel: lets LLVM vectorise the sums
@cached_jit(fastmath=FASTMATH, nogil=True, boundscheck=False)
def fold_rows(t, qmap, u, sc):
    """The query side of the fold (gare.psi_fold_queries.fold_queries) for a few queries in one call: t (a, d)
    f32; qmap (d, 2d + 3) f32 = [Rᵀ | Sᵀ | k2 | m0 | m1]; writes u (a, 3, d) = [t, u1, u2] and sc (a, 7) =
    [|t|², |Ct|², Σt, t·k2, t·m0, t·m1, 0]. y = t qmap streams qmap's rows once, four at a time (y stays
    in L1); one call instead of ~12 torch ops, whose dispatch was most of a one-query fold."""
    a, d = t.shape
    n = qmap.shape[1]
    y = np.empty(n, np.float32)
    for i in range(a):
        for j in range(n):
            y[j] = np.float32(0.0)
        k = 0
        while k + 4 <= d:
            t0, t1, t2, t3 = t[i, k], t[i, k + 1], t[i, k + 2], t[i, k + 3]
            for j in range(n):
                y[j] += t0 * qmap[k, j] + t1 * qmap[k + 1, j] + t2 * qmap[k + 2, j] + t3 * qmap[k + 3, j]
            k += 4
        while k < d:
            tk = t[i, k]
            for j in range(n):
                y[j] += tk * qmap[k, j]
            k += 1
        for k in range(d):
            u[i, 0, k] = t[i, k]
            u[i, 1, k] = y[k]
            u[i, 2, k] = y[d + k]
        # the sums in loops of their own, with no store: a loop that stores is versioned by LLVM on a run-time
        # check of its pointers, and the version taken (vector or scalar sum, another rounding) varied with the
        # number of rows in the call, so a query folded beside others had other bits than alone
        tt = np.float32(0.0)
        ts = np.float32(0.0)
        for k in range(d):
            x = t[i, k]
            tt += x * x
            ts += x
        mean = ts / np.float32(d)
        ctt = np.float32(0.0)
        for k in range(d):
            ct = t[i, k] - mean
            ctt += ct * ct
        sc[i, 0], sc[i, 1], sc[i, 2] = tt, ctt, ts
        sc[i, 3], sc[i, 4], sc[i, 5], sc[i, 6] = y[2 * d], y[2 * d + 1], y[2 * d + 2], np.float32(0.0)


def build() -> tuple[Any, Any]:
    """(kernel, widen_rows), compiled by numba on their first call for each layout of arguments, or loaded from
    its on-disk cache."""
    return kernel, widen_rows
