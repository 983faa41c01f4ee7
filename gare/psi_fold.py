"""psi folded exactly into per-video constants and per-query vectors (issue 12).

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

Public API (a queries, b videos, K candidates per query, f frames, d width):
- ``fold_weights(psi) -> PsiFold``: the weight products, once per checkpoint (``fingerprint`` ties stored
  constants to the weights);
- ``fold_videos(frames (b, f, d), mask (b, f) | None, psi_or_fold) -> VideoConstants`` (frames kept by
  reference; constants float32 on the frames' device);
- ``fold_queries(t (a, d), psi_or_fold, temp) -> QueryVectors``;
- ``pair_scores(q, v, idx=None) -> (a, b)`` scores, or ``(a, K)`` for candidate ids ``idx`` (a, K);
- ``exhaustive(q, v, chunk=...) -> (a, b)`` in bounded memory for whole galleries;
- ``rerank_scores(impl, ...)``: one switch over "fold" / "model" (gare_search.search.rerank_scores adds "fused").
Inputs may be float16/bfloat16 (stored features); everything is computed in float32 on the inputs' device.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from gare import psi_fold_cpu
from gare.psi import Psi

log = logging.getLogger(__name__)

_COS_EPS = 1e-8  # F.cosine_similarity's eps in gare.psi.pair_scores


# ------------------------------------------------------------------------------------------ weights
@dataclass(frozen=True)
class PsiFold:
    """psi's weights multiplied out (computed in float64, kept in float32). d = psi.dim.

    Names follow the module docstring.
    """

    dim: int
    eps: tuple[float, float, float]  # ε1, ε2, ε3 of LN1..LN3
    gamma1: torch.Tensor  # (d,)
    beta1: torch.Tensor  # (d,)
    a_e: torch.Tensor  # (d, d) A Γ1 C: v̄ -> the vector dotted with c_f for e_f
    k1: torch.Tensor  # (d,) A β1 + W_kᵀ b_q: dotted with c_f for g_f
    r: torch.Tensor  # (d, d) u1 = R t
    s: torch.Tensor  # (d, d) u2 = S t
    k2: torch.Tensor  # (d,) t·M_f = u2·F_f / σ_f + t·k2
    w_y: torch.Tensor  # (d, d) W_o W_v
    c0: torch.Tensor  # (d,)
    gamma2: torch.Tensor  # (d,)
    w_z: torch.Tensor  # (d, d) I + W_1
    cz0: torch.Tensor  # (d,) C z0
    gamma3: torch.Tensor  # (d,)
    w_mu: torch.Tensor  # (d, d)
    m0: torch.Tensor  # (d,)
    m1: torch.Tensor  # (d,)
    scalars: torch.Tensor  # (4,) |Cz0|², |m0|², m0·m1, |m1|²
    fingerprint: str  # sha256 of psi's parameters and eps: stored constants are only valid for it

    @property
    def device(self) -> torch.device:
        return self.r.device

    def to(self, device: torch.device | str) -> PsiFold:
        kw = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for k, v in kw.items():
            if isinstance(v, torch.Tensor):
                kw[k] = v.to(device)
        return PsiFold(**kw)


def psi_fingerprint(psi: Psi) -> str:
    h = hashlib.sha256()
    for name, p in sorted(psi.state_dict().items()):
        if name.startswith("log_sigma"):  # unused by the score
            continue
        h.update(name.encode())
        h.update(p.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    h.update(repr((psi.ln1.eps, psi.ln2.eps, psi.ln3.eps)).encode())
    return h.hexdigest()


def _ln_affine(ln: torch.nn.LayerNorm, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = ln.weight if ln.weight is not None else torch.ones(d)
    b = ln.bias if ln.bias is not None else torch.zeros(d)
    return g.detach().double().cpu(), b.detach().double().cpu()


def fold_weights(psi: Psi) -> PsiFold:
    """The per-checkpoint products (float64 on the CPU, returned as float32 on psi's device)."""
    if not isinstance(psi, Psi):
        raise TypeError(f"fold_weights needs a gare.psi.Psi, got {type(psi).__name__}")
    if psi.heads != 1:
        raise ValueError(f"psi_fold supports single-head psi only; this psi has heads={psi.heads}")
    d = psi.dim
    dev = psi.q.weight.device

    def lin(m: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor]:
        b = m.bias if m.bias is not None else torch.zeros(d)
        return m.weight.detach().double().cpu(), b.detach().double().cpu()

    with torch.no_grad():
        wq, bq = lin(psi.q)
        wk, _ = lin(psi.k)  # b_k only shifts every logit of a pair equally
        wv, bv = lin(psi.v)
        wo, bo = lin(psi.o)
        w1, b1 = lin(psi.ffn)
        wmu, bmu = lin(psi.mu)
        g1, be1 = _ln_affine(psi.ln1, d)
        g2, be2 = _ln_affine(psi.ln2, d)
        g3, be3 = _ln_affine(psi.ln3, d)
        eye = torch.eye(d, dtype=torch.float64)
        cm = eye - 1.0 / d  # centring operator C (d, d)
        a = wk.t() @ wq  # (d, d)
        a_e = a @ (g1[:, None] * cm)  # A Γ1 C
        k1 = a @ be1 + wk.t() @ bq
        r = cm @ (g1[:, None] * a_e)  # C Γ1 A Γ1 C
        w_y = wo @ wv
        c0 = wo @ bv + bo
        w_z = eye + w1
        z0 = w_z @ be2 + b1
        cz0 = cm @ z0
        m0 = wmu @ (g3 * cz0)
        m1 = wmu @ be3 + bmu
        bmat = wmu @ (g3[:, None] * cm) @ w_z @ (g2[:, None] * cm)  # W_μ Γ3 C (I+W_1) Γ2 C
        lmat = bmat @ w_y
        l0 = bmat @ c0
        s = cm @ (g1[:, None] * lmat.t())  # C Γ1 Lᵀ
        k2 = lmat @ be1 + l0
        scalars = torch.stack([cz0 @ cz0, m0 @ m0, m0 @ m1, m1 @ m1])

    def f32(x: torch.Tensor) -> torch.Tensor:
        return x.to(dev, torch.float32).contiguous()

    return PsiFold(
        dim=d,
        eps=(float(psi.ln1.eps), float(psi.ln2.eps), float(psi.ln3.eps)),
        gamma1=f32(g1), beta1=f32(be1), a_e=f32(a_e), k1=f32(k1), r=f32(r), s=f32(s), k2=f32(k2),
        w_y=f32(w_y), c0=f32(c0), gamma2=f32(g2), w_z=f32(w_z), cz0=f32(cz0), gamma3=f32(g3), w_mu=f32(wmu),
        m0=f32(m0), m1=f32(m1), scalars=f32(scalars), fingerprint=psi_fingerprint(psi),
    )


def _as_fold(psi: Psi | PsiFold) -> PsiFold:
    return psi if isinstance(psi, PsiFold) else fold_weights(psi)


# ------------------------------------------------------------------------------------------ videos
# Layout of one video's packed constants (one float row of width 10f + 5f² + 2), in this order.
VEC_FIELDS = ("rs", "bias", "le", "lg", "omega", "g2", "mu0", "mu1", "pi0", "pi1")  # (f,) each
MAT_FIELDS = ("g1", "g2m", "g3", "p", "h")  # (f, f) each
SCALAR_FIELDS = ("cvv", "vsum")  # scalars
CONST_FIELDS = (*VEC_FIELDS, *MAT_FIELDS, *SCALAR_FIELDS)


def packed_width(f: int) -> int:
    """Floats per video in `VideoConstants.packed` for f frames: 10f + 5f² + 2 (842 at f = 12)."""
    return len(VEC_FIELDS) * f + len(MAT_FIELDS) * f * f + len(SCALAR_FIELDS)


@dataclass(frozen=True)
class VideoConstants:
    """Per-video constants of the fold for b videos of f frames (see the module docstring).

    - ``frames`` (b, f, d): the stored frame features themselves (any float dtype, not copied): the pair
      stage dots them with the query vectors;
    - ``packed`` (b, 10f + 5f² + 2): every constant of a video in one row (float32 from `fold_videos`;
      it may be stored lower, e.g. float16, and is upcast on use). One row per video is what the index
      stores and what a rerank gathers (one index_select instead of 17);
    - ``fingerprint``: the psi weights the constants belong to (`PsiFold.fingerprint`).
    Named views (leading shape S = (b,) or whatever `select` was given): rs 1/σ_f, bias 0 or -inf (a frame the
    pooling skips; psi skips the frames with ω_f = 0), le e_f/√d, lg g_f/√d, omega ω_f, g2 g2_f, mu0 μ0_f, mu1 μ1_f, pi0 π0_f, pi1 π1_f: (*S, f);
    g1 G1, g2m G2, g3 G3, p P, h H: (*S, f, f); cvv |Cv̄|², vsum Σv̄: S.
    - ``vbar`` (b, d) or None: an explicit v̄ (kept by reference) when the caller's v̄ is not the masked mean
      of ``frames`` (the index rebuilds v̄ = norm * unit from float32 features while ``frames`` are stored
      float16). The pair stage then computes t·v̄ with one more dot per pair instead of Σ ω_f t·F_f;
      le, cvv and vsum in ``packed`` must have been folded from the same v̄ (``fold_videos(..., vbar=)``).
    """

    frames: torch.Tensor
    packed: torch.Tensor
    fingerprint: str
    vbar: torch.Tensor | None = None

    def __post_init__(self) -> None:
        f = self.frames.shape[-2]
        if self.packed.shape[:-1] != self.frames.shape[:-2] or self.packed.shape[-1] != packed_width(f):
            raise ValueError(f"packed constants {tuple(self.packed.shape)} do not match frames {tuple(self.frames.shape)}: "
                             f"expected {(*self.frames.shape[:-2], packed_width(f))}")
        if self.vbar is not None and tuple(self.vbar.shape) != (*self.frames.shape[:-2], self.frames.shape[-1]):
            raise ValueError(f"vbar {tuple(self.vbar.shape)} does not match frames {tuple(self.frames.shape)}")

    @property
    def n(self) -> int:
        return self.frames.shape[0]

    @property
    def num_frames(self) -> int:
        return self.frames.shape[-2]

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def field(self, name: str, packed: torch.Tensor | None = None) -> torch.Tensor:
        """A named view into `packed` (or into the given upcast copy of it)."""
        pk = self.packed if packed is None else packed
        f = self.num_frames
        if name in VEC_FIELDS:
            i = VEC_FIELDS.index(name) * f
            return pk[..., i : i + f]
        if name in MAT_FIELDS:
            i = len(VEC_FIELDS) * f + MAT_FIELDS.index(name) * f * f
            return pk[..., i : i + f * f].unflatten(-1, (f, f))
        if name in SCALAR_FIELDS:
            return pk[..., packed_width(f) - len(SCALAR_FIELDS) + SCALAR_FIELDS.index(name)]
        raise AttributeError(f"VideoConstants has no field {name!r}")

    def __getattr__(self, name: str) -> torch.Tensor:
        if name in CONST_FIELDS:
            return self.field(name)
        raise AttributeError(name)

    def select(self, idx: torch.Tensor) -> VideoConstants:
        """Rows idx (any shape S, int64) -> constants with leading shape S (frames gathered too)."""
        idx = torch.as_tensor(idx, dtype=torch.long)
        flat = idx.reshape(-1)

        def take(x: torch.Tensor) -> torch.Tensor:
            # index_select: several times faster than advanced indexing (x[idx]) on the CPU
            return x.index_select(0, flat.to(x.device)).view(*idx.shape, *x.shape[1:])

        return VideoConstants(frames=take(self.frames), packed=take(self.packed), fingerprint=self.fingerprint,
                              vbar=None if self.vbar is None else take(self.vbar))

    def slice(self, s0: int, s1: int) -> VideoConstants:
        return VideoConstants(frames=self.frames[s0:s1], packed=self.packed[s0:s1], fingerprint=self.fingerprint,
                              vbar=None if self.vbar is None else self.vbar[s0:s1])

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> VideoConstants:
        """Move everything to `device`; `dtype` (e.g. float16 for storage) applies to `packed` only."""
        fr, pk, vb = self.frames, self.packed, self.vbar
        if device is not None:
            fr, pk = fr.to(device), pk.to(device)
            vb = None if vb is None else vb.to(device)
        if dtype is not None:
            pk = pk.to(dtype)
        return VideoConstants(frames=fr, packed=pk, fingerprint=self.fingerprint, vbar=vb)

    @classmethod
    def cat(cls, parts: list[VideoConstants]) -> VideoConstants:
        if not parts:
            raise ValueError("cat needs at least one VideoConstants")
        fps = {p.fingerprint for p in parts}
        if len(fps) != 1:
            raise ValueError(f"cannot concatenate constants of different psi weights: {sorted(fps)}")
        if len({p.vbar is None for p in parts}) != 1:
            raise ValueError("cannot concatenate constants with and without an explicit vbar")
        vb = None if parts[0].vbar is None else torch.cat([p.vbar for p in parts])
        return cls(frames=torch.cat([p.frames for p in parts]), packed=torch.cat([p.packed for p in parts]),
                   fingerprint=parts[0].fingerprint, vbar=vb)

    def bytes_per_video(self) -> int:
        """Added bytes per video: one packed row at its current dtype (the frames are not counted)."""
        return self.packed.shape[-1] * self.packed.element_size()


def fold_videos(
    frames: torch.Tensor,
    mask: torch.Tensor | None,
    psi: Psi | PsiFold,
    *,
    chunk: int = 1024,
    reference_padding: bool = False,
    vbar: torch.Tensor | None = None,
) -> VideoConstants:
    """frames F (b, f, d) (any float dtype), mask (b, f) (bool/0-1; None = every row is real, the same as an
    all-ones mask) -> VideoConstants on the frames' device, float32.

    `reference_padding` (the model's ``cfg.reference_padding``): v̄ is the mean over all f rows and psi
    attends to every row (ω_f = 1/f marks them), while the pooling still skips the padded rows (bias -inf),
    as ``gare.psi.pair_scores(..., reference_padding=True)``; `frames` must hold the padded rows'
    features then.

    v̄ is the masked mean of the (upcast) frames, as `pair_scores(..., vbar=None)` computes it, unless `vbar`
    (b, d) is given (e.g. the index's norm * unit): then the constants use it and keep it by reference, and
    the pair stage adds one dot per pair (t·v̄). Work runs in
    chunks of `chunk` videos: three (chunk·f, d) x (d, d) products each.
    """
    fold = _as_fold(psi)
    if frames.ndim != 3 or frames.shape[-1] != fold.dim:
        raise ValueError(f"frames must be (b, f, {fold.dim}), got {tuple(frames.shape)}")
    b, f, d = frames.shape
    if mask is not None and tuple(mask.shape) != (b, f):
        raise ValueError(f"mask must be ({b}, {f}), got {tuple(mask.shape)}")
    if vbar is not None and tuple(vbar.shape) != (b, d):
        raise ValueError(f"vbar must be ({b}, {d}), got {tuple(vbar.shape)}")
    dev = frames.device
    fw = fold.to(dev) if fold.device != dev else fold
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    parts: list[torch.Tensor] = []
    sqd = math.sqrt(d)
    eps1 = fold.eps[0]
    with torch.no_grad():
        for s0 in range(0, b, chunk):
            fr = frames[s0 : s0 + chunk].to(torch.float32)  # (n, f, d)
            n = fr.shape[0]
            m = torch.ones(n, f, dtype=torch.bool, device=dev) if mask is None else mask[s0 : s0 + chunk].to(dev).bool()
            mf = m.to(torch.float32)
            if reference_padding:  # the plain mean over all rows; psi attends to every row with ω_f > 0
                omega = torch.full_like(mf, 1.0 / f)
            else:
                omega = mf / mf.sum(1, keepdim=True).clamp_min(1.0)  # masked_mean's weights
            vb = (torch.einsum("nf,nfd->nd", omega, fr) if vbar is None
                  else vbar[s0 : s0 + chunk].to(dev, torch.float32))  # (n, d)
            cf_raw = fr - fr.mean(-1, keepdim=True)
            rs = torch.rsqrt(cf_raw.pow(2).mean(-1) + eps1)  # (n, f) 1/σ_f
            c = F.layer_norm(fr, (d,), fw.gamma1, fw.beta1, eps1)  # (n, f, d) LN1(F)
            vc = vb - vb.mean(-1, keepdim=True)
            le = torch.einsum("nd,nfd->nf", vb @ fw.a_e.t(), c) / sqd
            lg = (c @ fw.k1) / sqd
            y = torch.addmm(fw.c0, c.reshape(-1, d), fw.w_y.t())  # (n·f, d)
            cy = y - y.mean(-1, keepdim=True)
            z = (cy * fw.gamma2) @ fw.w_z.t()  # (n·f, d): Z_f without z0
            cz = z - z.mean(-1, keepdim=True)
            mm = (cz * fw.gamma3) @ fw.w_mu.t()  # (n·f, d): M_f
            cy, cz, mm = cy.view(n, f, d), cz.view(n, f, d), mm.view(n, f, d)
            fields = dict(
                    rs=rs,
                    bias=torch.zeros(n, f, device=dev).masked_fill(~m, float("-inf")),
                    le=le,
                    lg=lg,
                    omega=omega,
                    g2=cz @ fw.cz0,
                    mu0=mm @ fw.m0,
                    mu1=mm @ fw.m1,
                    pi0=fr @ fw.m0,
                    pi1=fr @ fw.m1,
                    g1=cy @ cy.transpose(1, 2),
                    g2m=cz @ cz.transpose(1, 2),
                    g3=mm @ mm.transpose(1, 2),
                    p=mm @ fr.transpose(1, 2),
                    h=fr @ fr.transpose(1, 2),
                    cvv=vc.pow(2).sum(-1),
                    vsum=vb.sum(-1),
            )
            parts.append(torch.cat([fields[k].reshape(n, -1) for k in CONST_FIELDS], dim=1))  # (n, packed_width)
    packed = torch.cat(parts) if parts else torch.empty(0, packed_width(f), device=dev)
    return VideoConstants(frames=frames, packed=packed, fingerprint=fold.fingerprint, vbar=vbar)


# ------------------------------------------------------------------------------------------ queries
@dataclass(frozen=True)
class QueryVectors:
    """Per-query vectors for a queries: u (a, 3, d) = [t, u1, u2] (dotted with every frame), and per-query
    scalars sc (a, 7) = [|t|², |Ct|², Σt, t·k2, t·m0, t·m1, unused 0]; plus the weight scalars and eps."""

    u: torch.Tensor
    sc: torch.Tensor
    wsc: torch.Tensor  # (4,) |Cz0|², |m0|², m0·m1, |m1|²
    eps: tuple[float, float, float]
    inv_temp: float
    fingerprint: str

    @property
    def n(self) -> int:
        return self.u.shape[0]

    @property
    def device(self) -> torch.device:
        return self.u.device


def fold_queries(t: torch.Tensor, psi: Psi | PsiFold, temp: float) -> QueryVectors:
    """t (a, d) text embeddings (any float dtype) -> QueryVectors (float32 on t's device); temp = the model's
    pooling temperature (cfg.temp)."""
    fold = _as_fold(psi)
    if t.ndim != 2 or t.shape[1] != fold.dim:
        raise ValueError(f"t must be (a, {fold.dim}), got {tuple(t.shape)}")
    if not temp > 0:
        raise ValueError(f"temp must be > 0, got {temp}")
    dev = t.device
    fw = fold.to(dev) if fold.device != dev else fold
    with torch.no_grad():
        t = t.to(torch.float32)
        ct = t - t.mean(-1, keepdim=True)
        u = torch.stack([t, t @ fw.r.t(), t @ fw.s.t()], dim=1)  # (a, 3, d)
        sc = torch.stack(
            [t.pow(2).sum(-1), ct.pow(2).sum(-1), t.sum(-1), t @ fw.k2, t @ fw.m0, t @ fw.m1, torch.zeros_like(t[:, 0])],
            dim=1,
        )
    return QueryVectors(u=u.contiguous(), sc=sc, wsc=fw.scalars, eps=fold.eps, inv_temp=1.0 / float(temp),
                        fingerprint=fold.fingerprint)


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
# queries the torch path's shared frame upcast wins by 1.2-1.5x; measured with bench/psi_fold.py's sizes).
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


# ------------------------------------------------------------------------------------------ switch
# The light core offers the fold and the model path; the fused path lives in gare_search.search (above this
# layer), which dispatches all three.
RERANK_IMPLS = ("fold", "model")


def rerank_scores(
    impl: str,
    model: Any,
    t: torch.Tensor,
    frames: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    consts: VideoConstants | None = None,
    fold: PsiFold | None = None,
) -> torch.Tensor:
    """One switch over the psi implementations for P (text, video) pairs: t (P, d), frames (P, f, d),
    mask (P, f) -> s (P,) float32 on t's device. v̄ is the masked mean of `frames` on every path (the mean
    over all rows when ``model.cfg.reference_padding``), so the three agree to float32 rounding.

    "fold": `consts` (P rows, already gathered for these pairs) or folded here from frames/mask (`fold` =
    cached `fold_weights(model.psi)`); "model": `model.score` pair by pair.
    """
    if impl not in RERANK_IMPLS:
        raise ValueError(f"rerank impl must be one of {RERANK_IMPLS}, got {impl!r}")

    P = t.shape[0]
    if frames.shape[0] != P:
        raise ValueError(f"t has {P} rows but frames has {frames.shape[0]}")
    dev = t.device
    with torch.inference_mode():
        if impl == "fold":
            fw = fold if fold is not None else fold_weights(model.psi)
            v = consts if consts is not None else fold_videos(
                frames.to(dev), mask, fw, reference_padding=getattr(model.cfg, "reference_padding", False))
            if v.n != P:
                raise ValueError(f"consts has {v.n} rows for {P} pairs")
            q = fold_queries(t, fw, model.cfg.temp)
            return _diag(q, v.to(dev))
        fr = frames.to(dev, torch.float32)
        mk = None if mask is None else mask.to(dev)
        out = torch.empty(P, device=dev)
        for i in range(P):
            out[i] = model.score(t[i : i + 1].float(), fr[i : i + 1], None if mk is None else mk[i : i + 1])[0, 0]
        return out


def _diag(q: QueryVectors, v: VideoConstants) -> torch.Tensor:
    """Scores of the pairs (query i, video i): q with P queries, v with P videos -> (P,)."""
    P = q.u.shape[0]
    fr = v.frames.to(v.device, torch.float32)
    dots = torch.einsum("ped,pfd->pef", q.u, fr)  # (P, 3, f)
    # Treat the P pairs as P queries with one candidate each: fields (P, 1, ...).
    vt = None if v.vbar is None else (q.u[:, 0] * _f32(v.vbar)).sum(-1)[:, None]  # (P, 1)
    return _scores_from_dots(q, v.packed.unsqueeze(1), v.num_frames, dots[:, None, 0], dots[:, None, 1],
                             dots[:, None, 2], vt).view(P)
