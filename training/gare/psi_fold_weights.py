"""psi's weights folded once per checkpoint: `PsiFold` (the d x d products of the fold) and its fingerprint.

The products and their names follow the derivation in :mod:`gare.psi_fold` (steps 1-5); the fingerprint ties
constants stored by an index to the psi weights they were folded from.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

import torch

from gare.psi import Psi


@dataclass(frozen=True)
class PsiFold:
    """psi's weights multiplied out (computed in float64, kept in float32). d = psi.dim.

    Names follow the derivation in :mod:`gare.psi_fold`.
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
    # (d, 2d + 3) [Rᵀ | Sᵀ | k2 | m0 | m1]: a query's u1, u2 and t·k2, t·m0, t·m1 in one product (one op per
    # query batch instead of five: at one query the count of ops, not their arithmetic, is the cost)
    query_map: torch.Tensor = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        qm = torch.cat([self.r.t(), self.s.t(), self.k2[:, None], self.m0[:, None], self.m1[:, None]], dim=1)
        object.__setattr__(self, "query_map", qm.contiguous())

    @property
    def device(self) -> torch.device:
        return self.r.device

    def to(self, device: torch.device | str) -> PsiFold:
        kw = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
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



def as_fold(psi: Psi | PsiFold) -> PsiFold:
    """psi's fold: the given `PsiFold`, or `fold_weights(psi)`."""
    return psi if isinstance(psi, PsiFold) else fold_weights(psi)

