"""psi folded exactly: the pair scores from per-video constants and per-query vectors.

`gare.psi.pair_scores` costs ~4 d x d products per (text, video) pair. Every piece of psi is a linear
map or a LayerNorm, so each linear map can be moved to the query side (once per query) or the video side
(once per video, at index time), and each LayerNorm's scale becomes a quadratic form in the pair's f
attention weights. What is left per pair is 3f dot products of length d (the stored frames against three
query vectors) plus O(f²) work on small per-video matrices. The result equals `pair_scores` up to float32
rounding (tests: within 1e-5); nothing is approximated.

Notation (one video, one text; f frames, d width): ``C x = x - mean(x)`` (centring, C = Cᵀ = C²);
``LN_k(x) = γ_k ⊙ C x / s(x) + β_k`` with ``s(x) = sqrt(|C x|²/d + ε_k)``; ``Γ_k = diag(γ_k)``; the frames
``F_f``; ``σ_f = s(F_f)`` (LN1's scale of frame f) so ``c_f := LN1(F_f) = γ1 ⊙ C F_f / σ_f + β1``; the frame
weights of v̄, ``ω_f = m_f / max(1, Σ m)`` (``1/f`` for every row in the all-rows mode), ``v̄ = Σ ω_f F_f``;
psi attends to the rows v̄ averages (``ω_f > 0``: the real ones, or every row in the all-rows mode) and the
pooling to the real ones (``m_f = 1``); an excluded frame gets logit -inf, exactly as ``pair_scores`` masks
it (a video with no real frame therefore scores NaN there and here). The all-rows mode
(``fold_videos(..., reference_padding=True)``) is the authors' padding, for checkpoints with
``cfg.reference_padding``: v̄ over all f rows and psi attending to padded rows too, pooling still masked.
``mask=None`` is not that mode: it treats every row as real, so the pooling would use padded rows as well.

1. Attention logits. ``h = LN1(v̄ - t)``, ``l_f = (W_q h + b_q)·(W_k c_f + b_k)/√d``. The term with b_k is
   the same for every f and cancels in the softmax, so with ``A = W_kᵀ W_q``:
   ``l_f ≅ [(A Γ1 C v̄)·c_f - (A Γ1 C t)·c_f] / (s1 √d) + (A β1 + W_kᵀ b_q)·c_f / √d``.
   ``e_f = (A Γ1 C v̄)·c_f`` and ``g_f = (A β1 + W_kᵀ b_q)·c_f`` are per-video scalars. With ``u1 = R t``,
   ``R = C Γ1 A Γ1 C`` (once per query), ``(A Γ1 C t)·c_f = (u1·F_f)/σ_f + const`` (the const cancels).
   ``s1² = (|Cv̄|² - 2 v̄·Ct + |Ct|²)/d + ε1`` with ``v̄·Ct = v̄·t - Σv̄ Σt / d`` and ``v̄·t = Σ_f ω_f t·F_f``.
   The attention weights ``a = softmax_f(l)`` then cost 2f dots: t·F_f (needed for pooling anyway), u1·F_f.
2. psi's output. ``y = W_o(Σ_f a_f (W_v c_f + b_v)) + b_o = Σ_f a_f Y_f`` with ``Y_f = W_o W_v c_f + c0``,
   ``c0 = W_o b_v + b_o`` (Σ a_f = 1 absorbs every constant). ``C y = Σ a_f C Y_f`` so
   ``s2² = aᵀ G1 a / d + ε2`` with ``G1 = [C Y_f · C Y_g]`` (f x f), and
   ``x = LN2(y) = Σ a_f X_f / s2 + β2`` with ``X_f = γ2 ⊙ C Y_f``.
3. FFN and LN3 (dropout is the identity at inference). ``z = x + W_1 x + b_1 = Σ a_f Z_f / s2 + z0`` with
   ``Z_f = (I + W_1) X_f``, ``z0 = (I + W_1) β2 + b_1``; ``s3² = (aᵀ G2 a / s2² + 2 a·g2 / s2 + |Cz0|²)/d + ε3``
   with ``G2 = [C Z_f · C Z_g]``, ``g2_f = C Z_f · C z0``.
4. ``Δ = W_μ LN3(z) + b_μ = (Σ a_f M_f / s2 + m0) / s3 + m1`` with ``M_f = W_μ(γ3 ⊙ C Z_f)``,
   ``m0 = W_μ(γ3 ⊙ C z0)``, ``m1 = W_μ β3 + b_μ`` (m0, m1 depend on the weights only).
5. Score ``cos(t + Δ, p)``, ``p = Σ_g w_g F_g``, ``w = softmax_g(t·F_g / temp)`` over the real frames:
   ``t·p = Σ w_g t·F_g``; ``|p|² = wᵀ H w``, ``H = [F_f·F_g]``;
   ``Δ·p = Σ_g w_g [((aᵀP)_g / s2 + π0_g) / s3 + π1_g]`` with ``P = [M_f·F_g]``, ``π0_g = m0·F_g``, ``π1_g = m1·F_g``;
   ``t·Δ = ((Σ a_f t·M_f) / s2 + t·m0) / s3 + t·m1`` where ``M_f = L c_f + l0`` is linear in c_f
   (``L = W_μ Γ3 C (I+W_1) Γ2 C W_o W_v``, ``l0`` likewise from c0), so ``t·M_f = (u2·F_f)/σ_f + t·k2`` with
   ``u2 = C Γ1 Lᵀ t`` and ``k2 = L β1 + l0``: the third f dots;
   ``|Δ|² = (aᵀ G3 a / s2² + 2 a·μ0 / s2 + |m0|²) / s3² + 2 (a·μ1 / s2 + m0·m1) / s3 + |m1|²`` with
   ``G3 = [M_f·M_g]``, ``μ0_f = M_f·m0``, ``μ1_f = M_f·m1``;
   ``s = (t·p + Δ·p) / (max(|t + Δ|, 1e-8) max(|p|, 1e-8))`` (the clamp `F.cosine_similarity` applies).

Per video this stores 5 f x f matrices (G1, G2, G3, P, H) and 10 f-vectors (1/σ, frame bias, e, g, ω, g2,
μ0, μ1, π0, π1) plus 2 scalars (|Cv̄|², Σv̄), packed in one row: at f = 12 that is 842 floats, 3,368 bytes in
float32 (`VideoConstants.bytes_per_video`; 1,684 in float16, which costs ~3e-5 in the score), on top of the frames the index already stores (the pair stage needs
them for the 3f dots). The constants cost three d x d products per frame once, at index time.

Public API (a queries, b videos, K candidates per query, f frames, d width), by module:
- :mod:`gare.psi_fold_weights`: ``fold_weights(psi) -> PsiFold``, the weight products, once per checkpoint
  (``fingerprint`` ties stored constants to the weights);
- :mod:`gare.psi_fold_videos`: ``fold_videos(frames (b, f, d), mask (b, f) | None, psi_or_fold) ->
  VideoConstants`` (frames kept by reference; constants float32 on the frames' device);
- :mod:`gare.psi_fold_queries`: ``fold_queries(t (a, d), psi_or_fold, temp) -> QueryVectors``;
- here: ``pair_scores(q, v, idx=None) -> (a, b)`` scores, or ``(a, K)`` for candidate ids ``idx`` (a, K);
  ``exhaustive(q, v, chunk=...) -> (a, b)`` in bounded memory for whole galleries; ``fold_pair_scores(model, t,
  frames, mask)`` for P (text, video) pairs; the compiled CPU form of ``pair_scores`` is :mod:`gare.psi_fold_cpu`.
Inputs may be float16/bfloat16 (stored features); everything is computed in float32 on the inputs' device.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from typing import Any

import torch

from gare import psi_fold_cpu
from gare.psi_fold_queries import QueryVectors, fold_queries
from gare.psi_fold_videos import MAT_FIELDS, VEC_FIELDS, VideoConstants, fold_videos
from gare.psi_fold_weights import PsiFold, fold_weights

log = logging.getLogger(__name__)

_COS_EPS = 1e-8  # F.cosine_similarity's eps in gare.psi.pair_scores


# ------------------------------------------------------------------------------------------ pairs
def _f32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 else x.float()


_Y_ROWS = torch.tensor([0, 0, 0, 0, 1])  # [a, a, a, a, w] from the stacked (a, w)


def _scores_from_dots(q: QueryVectors, packed: torch.Tensor, f: int, dt: torch.Tensor, d1: torch.Tensor,
                      d2: torch.Tensor, vt: torch.Tensor | None = None) -> torch.Tensor:
    """dt, d1, d2 (a, n, f) = t·F_f, u1·F_f, u2·F_f; packed (n, W) constants shared by the queries or (a, n, W)
    -> s (a, n); vt (a, n) = t·v̄ when the constants carry an explicit v̄ (else Σ ω_f t·F_f). Fields used together
    sit side by side in the packed row and every f x f form is taken in one op: at K = 256 the count of these
    small ops, not their arithmetic, is the cost."""
    d = q.u.shape[-1]
    eps1, eps2, eps3 = q.eps
    tt, ctt, tsum, tk2, tm0, tm1, _ = q.sc[:, None, :].unbind(-1)  # (a, 1) each
    cz0, m00, m01, m11 = (float(x) for x in q.wsc.tolist())
    pk = _f32(packed)  # one upcast when the constants are stored lower
    nv, nm = len(VEC_FIELDS), len(MAT_FIELDS)
    vec = pk[..., : nv * f].unflatten(-1, (nv, f))  # (.., 10, f) in VEC_FIELDS order
    mat = pk[..., nv * f : nv * f + nm * f * f].unflatten(-1, (nm, f, f))  # (.., 5, f, f) in MAT_FIELDS order
    rs, bias, le, lg, omega = vec[..., :5, :].unbind(-2)
    cvv, vsum = pk[..., -2], pk[..., -1]
    # ---- psi's attention weights a and the pooling weights w (a, n, f), one softmax for both
    vct = ((omega * dt).sum(-1) if vt is None else vt) - vsum * tsum / d  # v̄·Ct
    s1 = torch.sqrt((cvv - 2.0 * vct + ctt).clamp_min(0.0) / d + eps1)  # (a, n)
    # psi attends to the rows v̄ averages (ω_f > 0); equal to `bias` unless folded with reference_padding
    la = ((le - d1 * rs / math.sqrt(d)) / s1.unsqueeze(-1) + lg).masked_fill(omega <= 0, float("-inf"))
    aw = torch.stack([la, torch.broadcast_to(dt * q.inv_temp + bias, la.shape)], dim=-2).softmax(-1)  # (a, n, 2, f)
    a, w = aw.unbind(-2)
    # ---- every form with the five f x f matrices at once: Y = [a, a, a, a, w] (a, n, 5, f);
    # R_k = Y_kᵀ M_k gives G1a, G2a, G3a (symmetric), aᵀP and Hw; (R·Y) gives aᵀG1a, aᵀG2a, aᵀG3a, -, wᵀHw
    y = aw.index_select(-2, _Y_ROWS.to(aw.device))
    r = (mat * y.unsqueeze(-1)).sum(-2)  # (a, n, 5, f)
    quad = (r * y).sum(-1)  # (a, n, 5)
    lin = (vec[..., 5:8, :] * a.unsqueeze(-2)).sum(-1)  # (a, n, 3): a·g2, a·μ0, a·μ1
    s2 = torch.sqrt(quad[..., 0].clamp_min(0.0) / d + eps2)
    s3 = torch.sqrt((quad[..., 1] / s2**2 + 2.0 * lin[..., 0] / s2 + cz0).clamp_min(0.0) / d + eps3)
    # ---- t·Δ and |Δ|²
    t_delta = (((a * d2 * rs).sum(-1) + tk2) / s2 + tm0) / s3 + tm1  # Σ a_f t·M_f = Σ a_f u2·F_f/σ_f + t·k2
    dd = (quad[..., 2] / s2**2 + 2.0 * lin[..., 1] / s2 + m00) / s3**2 + 2.0 * (lin[..., 2] / s2 + m01) / s3 + m11
    # ---- pooling p and the cosine: t·p + Δ·p = Σ_g w_g [t·F_g + ((aᵀP)_g / s2 + π0_g) / s3 + π1_g]
    s2e, s3e = s2.unsqueeze(-1), s3.unsqueeze(-1)
    tdp = (w * (dt + (r[..., 3, :] / s2e + vec[..., 8, :]) / s3e + vec[..., 9, :])).sum(-1)
    nx = (tt + 2.0 * t_delta + dd).clamp_min(0.0).sqrt()
    npp = quad[..., 4].clamp_min(0.0).sqrt()
    return tdp / (nx.clamp_min(_COS_EPS) * npp.clamp_min(_COS_EPS))


_CHUNK_VIDEOS = 64  # videos upcast at a time: 1.5 MB of float32 at f = 12, d = 512 (stays in cache), kept per thread
_BUF = threading.local()


def _frame_dots(frames: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """frames (n, f, d) any float dtype, u (m, d) float32 -> (m, n·f) float32 dots of every frame with every u.

    Lower-precision frames on the CPU are upcast chunk by chunk into one buffer that each thread keeps: a fresh
    multi-MB float32 copy per call costs more in page faults than the copy and the product together."""
    n, f, d = frames.shape
    flat = frames.reshape(n * f, d)
    if frames.dtype == torch.float32 or frames.device.type != "cpu" or n == 0:
        return u @ _f32(flat).t()
    rows = min(n, _CHUNK_VIDEOS) * f
    buf = getattr(_BUF, "t", None)
    if buf is None or buf.numel() < rows * d:
        # a normal tensor even when the first call runs under inference_mode: an inference tensor could not
        # be written in place by a later call outside it
        with torch.inference_mode(False):
            buf = _BUF.t = torch.empty(rows * d, dtype=torch.float32)
    parts = []
    for r0 in range(0, n * f, rows):
        r1 = min(n * f, r0 + rows)
        b = buf[: (r1 - r0) * d].view(r1 - r0, d)
        b.copy_(flat[r0:r1])
        parts.append(u @ b.t())
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def cpu_kernel_usable(v: VideoConstants) -> bool:
    """Whether `gare.psi_fold_cpu` can score candidates of v: CPU tensors, float16/float32 frames and
    constants, float32 v̄ (if any), and numba importable."""
    ok = {torch.float16, torch.float32}
    return (v.device.type == "cpu" and v.frames.device.type == "cpu" and v.frames.dtype in ok and v.packed.dtype in ok
            and (v.vbar is None or v.vbar.dtype == torch.float32) and psi_fold_cpu.available())


def pair_scores(q: QueryVectors, v: VideoConstants, idx: torch.Tensor | None = None, *,
                kernel: bool | None = None) -> torch.Tensor:
    """psi scores s_tj in float32 on v's device.

    idx None: every query against every video of v -> (a, b). idx (a, K) int64 row ids into v (candidates of
    each query; repeats allowed) -> (a, K), equal to the full scores gathered at idx.

    `kernel` (candidates only): None = the compiled CPU kernel (`gare.psi_fold_cpu`) when
    `cpu_kernel_usable(v)`, else these torch ops; True = the kernel or an error; False = torch ops (the
    reference the kernel is tested against, and the CUDA path).
    """
    if q.fingerprint != v.fingerprint:
        raise ValueError(f"query vectors (psi {q.fingerprint[:12]}) and video constants (psi {v.fingerprint[:12]}) "
                         "come from different psi weights")
    dev = v.device
    if idx is not None and kernel is not False:
        usable = cpu_kernel_usable(v)
        if kernel and not usable:
            raise ValueError(f"the CPU kernel cannot score these constants (device {dev}, frames {v.frames.dtype}, "
                             f"constants {v.packed.dtype}; numba importable: {psi_fold_cpu.available()})")
        if usable:
            ix = torch.as_tensor(idx, dtype=torch.long).cpu().numpy()
            with torch.no_grad():
                return torch.from_numpy(psi_fold_cpu.pair_scores(q, v.frames, v.packed, ix, vrows=v.vbar))
    if q.device != dev:
        q = dataclasses.replace(q, u=q.u.to(dev), sc=q.sc.to(dev), wsc=q.wsc.to(dev))
    a, _, d = q.u.shape
    with torch.no_grad():
        if idx is None:
            return _all_pairs(q, v, None)
        idx = torch.as_tensor(idx, dtype=torch.long, device=dev)
        if idx.ndim != 2 or idx.shape[0] != a:
            raise ValueError(f"idx must be ({a}, K) candidate ids, got {tuple(idx.shape)}")
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= v.n):
            raise ValueError(f"candidate ids must lie in [0, {v.n}), got [{int(idx.min())}, {int(idx.max())}]")
        k, f = idx.shape[1], v.frames.shape[1]
        if v.n <= idx.numel():
            # v holds (about) just the candidates, e.g. the unique rows of a batch: dot every frame of v with
            # every query's 3 vectors in one product (each frame upcast once, no gathered copy of the frames),
            # then take the (a, 3, K, f) dots and the packed rows each query needs, unless the candidates
            # already are v's rows in order (one query, the common rerank).
            dots = _frame_dots(v.frames, q.u.reshape(3 * a, d)).view(a, 3, v.n, f)
            vt = None if v.vbar is None else q.u[:, 0] @ _f32(v.vbar).t()  # (a, n) t·v̄
            if a == 1 and k == v.n and torch.equal(idx[0], torch.arange(k, device=dev)):
                return _scores_from_dots(q, v.packed, f, dots[:, 0], dots[:, 1], dots[:, 2], vt)
            g = torch.gather(dots, 2, idx[:, None, :, None].expand(a, 3, k, f))  # (a, 3, K, f)
            packed = v.packed.index_select(0, idx.reshape(-1)).view(a, k, -1)
            vt = None if vt is None else torch.gather(vt, 1, idx)
            return _scores_from_dots(q, packed, f, g[:, 0], g[:, 1], g[:, 2], vt)
        vs = v.select(idx)  # fields (a, K, ...)
        fr = vs.frames.to(torch.float32).reshape(a, k * f, d)
        dots = torch.bmm(fr, q.u.transpose(1, 2)).view(a, k, f, 3).permute(0, 3, 1, 2)  # (a, 3, K, f)
        vt = None if vs.vbar is None else torch.bmm(_f32(vs.vbar), q.u[:, 0, :, None]).view(a, k)
        return _scores_from_dots(q, vs.packed, f, dots[:, 0], dots[:, 1], dots[:, 2], vt)


def _all_pairs(q: QueryVectors, v: VideoConstants, buf: torch.Tensor | None) -> torch.Tensor:
    """Every query of q against every video of v -> (a, b). `buf`: a reusable float32 buffer of at least
    b·f·d elements for the upcast frames (a fresh 100 MB allocation costs more page faults than the work)."""
    a, _, d = q.u.shape
    b, f = v.frames.shape[:2]
    if v.frames.dtype == torch.float32:
        fr = v.frames.reshape(b * f, d)
    elif buf is not None:
        fr = buf[: b * f * d].view(b * f, d)
        fr.copy_(v.frames.reshape(b * f, d))
    else:
        fr = v.frames.to(torch.float32).reshape(b * f, d)
    dots = (q.u.reshape(3 * a, d) @ fr.t()).view(a, 3, b, f)
    vt = None if v.vbar is None else q.u[:, 0] @ _f32(v.vbar).t()  # (a, b)
    return _scores_from_dots(q, v.packed, f, dots[:, 0], dots[:, 1], dots[:, 2], vt)


# Below this many queries the CPU kernel scores a whole gallery faster than the torch ops (1 query: 4.5x; at 16
# queries the torch path's shared frame upcast wins by 1.2-1.5x; measured at K = 256, f = 12, d = 512).
_KERNEL_MAX_QUERIES = 8


def exhaustive(
    q: QueryVectors,
    v: VideoConstants,
    *,
    chunk: int = 512,
    query_chunk: int = 16,
    device: torch.device | str | None = None,
    progress: bool = False,
    kernel: bool | None = None,
) -> torch.Tensor:
    """Every query against every video: (a, b) float32 on the CPU, in chunks of `chunk` videos and
    `query_chunk` queries so memory stays bounded (~chunk·f·d·4 bytes for the upcast frames plus
    ~query_chunk·chunk·f²·12 bytes) whatever b is. `v` may live on the CPU (even memory-mapped); each chunk is
    moved to `device` (default: v's device) for the work. 512-video chunks keep the upcast frames (12 MB at
    f = 12, d = 512) in cache. `kernel`: None = the CPU kernel (`pair_scores(..., kernel=True)`) for fewer
    than _KERNEL_MAX_QUERIES queries when `cpu_kernel_usable`, else the batched torch ops; True / False force
    one or the other."""
    if chunk < 1 or query_chunk < 1:
        raise ValueError(f"chunk and query_chunk must be >= 1, got {chunk}, {query_chunk}")
    dev = torch.device(device) if device is not None else v.device
    out = torch.empty(q.n, v.n, dtype=torch.float32)
    starts = range(0, v.n, chunk)
    if progress:
        from tqdm import tqdm

        starts = tqdm(starts, desc="exhaustive psi (fold)", unit="chunk")
    if q.fingerprint != v.fingerprint:
        raise ValueError(f"query vectors (psi {q.fingerprint[:12]}) and video constants (psi {v.fingerprint[:12]}) "
                         "come from different psi weights")
    q = dataclasses.replace(q, u=q.u.to(dev), sc=q.sc.to(dev), wsc=q.wsc.to(dev))
    buf = torch.empty(min(chunk, v.n) * v.num_frames * q.u.shape[-1], dtype=torch.float32, device=dev)
    with torch.no_grad():
        for s0 in starts:
            vc = v.slice(s0, s0 + chunk).to(dev)  # chunk rows (a copy only when v lives elsewhere)
            use_kernel = (q.n < _KERNEL_MAX_QUERIES and cpu_kernel_usable(vc)) if kernel is None else kernel
            for i0 in range(0, q.n, query_chunk):
                qc = dataclasses.replace(q, u=q.u[i0 : i0 + query_chunk], sc=q.sc[i0 : i0 + query_chunk])
                if use_kernel:
                    idx = torch.arange(vc.n).expand(qc.n, vc.n)
                    out[i0 : i0 + query_chunk, s0 : s0 + vc.n] = pair_scores(qc, vc, idx, kernel=True)
                else:
                    out[i0 : i0 + query_chunk, s0 : s0 + vc.n] = _all_pairs(qc, vc, buf).cpu()
    return out


# ------------------------------------------------------------------------------------------ pairs
def fold_pair_scores(
    model: Any,
    t: torch.Tensor,
    frames: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    consts: VideoConstants | None = None,
    fold: PsiFold | None = None,
) -> torch.Tensor:
    """psi scores of P (text, video) pairs by the fold: t (P, d), frames (P, f, d), mask (P, f) -> s (P,)
    float32 on t's device. v̄ is the masked mean of `frames` (the mean over all rows when
    ``model.cfg.reference_padding``), as in ``model.score``, which the tests check this against.

    `consts`: the P pairs' video constants, already gathered, or folded here from frames/mask; `fold`: the
    cached ``fold_weights(model.psi)``."""
    P = t.shape[0]
    if frames.shape[0] != P:
        raise ValueError(f"t has {P} rows but frames has {frames.shape[0]}")
    dev = t.device
    with torch.inference_mode():
        fw = fold if fold is not None else fold_weights(model.psi)
        v = consts if consts is not None else fold_videos(
            frames.to(dev), mask, fw, reference_padding=getattr(model.cfg, "reference_padding", False))
        if v.n != P:
            raise ValueError(f"consts has {v.n} rows for {P} pairs")
        q = fold_queries(t, fw, model.cfg.temp)
        return diagonal_scores(q, v.to(dev))


def diagonal_scores(q: QueryVectors, v: VideoConstants) -> torch.Tensor:
    """Scores of the pairs (query i, video i): q with P queries, v with P videos -> (P,)."""
    P = q.u.shape[0]
    fr = v.frames.to(v.device, torch.float32)
    dots = torch.einsum("ped,pfd->pef", q.u, fr)  # (P, 3, f)
    # Treat the P pairs as P queries with one candidate each: fields (P, 1, ...).
    vt = None if v.vbar is None else (q.u[:, 0] * _f32(v.vbar)).sum(-1)[:, None]  # (P, 1)
    return _scores_from_dots(q, v.packed.unsqueeze(1), v.num_frames, dots[:, None, 0], dots[:, None, 1],
                             dots[:, None, 2], vt).view(P)
