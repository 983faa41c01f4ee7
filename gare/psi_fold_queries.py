"""psi's per-query vectors: `QueryVectors` and `fold_queries` (three vectors and seven scalars per text).

Names follow the derivation in :mod:`gare.psi_fold`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gare.psi import Psi
from gare.psi_fold_weights import PsiFold, as_fold


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
    fold = as_fold(psi)
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

