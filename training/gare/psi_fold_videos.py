"""psi's per-video constants: their packed layout, `VideoConstants`, and `fold_videos` that computes them.

Per video the fold stores 5 f x f matrices (G1, G2, G3, P, H) and 10 f-vectors plus 2 scalars in one row (the
derivation and the names are in :mod:`gare.psi_fold`); an index stores these rows beside its frames.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gare.psi import Psi
from gare.psi_fold_weights import PsiFold, as_fold

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
    """Per-video constants of the fold for b videos of f frames (see :mod:`gare.psi_fold`).

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
    fold = as_fold(psi)
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

