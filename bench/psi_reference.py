"""The fused psi scorer the benchmarks compare the served fold against (bench/ keeps its own copy: the product
serves only the fold, and bench/ may not import tests/, where the test suite's reference lives).

``fused_pair_scores`` is the search's rerank before the fold (psi's attention with W_kᵀW_q and W_o·W_v folded,
computed per pair); ``fused_pair_scorer`` wraps it over index arrays the way the builder's served-bias scorer
was called. Both equal ``model.score`` to float32 rounding.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


class FoldedAttention:
    """psi's attention weights folded: w_qk = W_kᵀ W_q per head (and b_qk), w_ov = W_o W_v (and b_ov)."""

    def __init__(self, psi: Any) -> None:
        d, H = psi.dim, psi.heads
        hd = d // H
        with torch.no_grad():
            wq = psi.q.weight.detach().float().view(H, hd, d)
            wk = psi.k.weight.detach().float().view(H, hd, d)
            wv = psi.v.weight.detach().float().view(H, hd, d)
            wo = psi.o.weight.detach().float().view(d, H, hd)
            self.w_qk = torch.einsum("hed,hec->hdc", wk, wq).reshape(H * d, d).contiguous()
            self.b_qk = torch.einsum("hed,he->hd", wk, psi.q.bias.detach().float().view(H, hd)).reshape(H * d).contiguous()
            self.w_ov = torch.einsum("ohe,hed->ohd", wo, wv).reshape(d, H * d).contiguous()
            self.b_ov = (psi.o.weight.detach().float() @ psi.v.bias.detach().float()
                         + psi.o.bias.detach().float()).contiguous()


def fused_pair_scores(model: Any, t: torch.Tensor, frames: torch.Tensor, mask: torch.Tensor | None,
                      vbar: torch.Tensor, folded: FoldedAttention | None = None) -> torch.Tensor:
    """s (P,) for P (text, video) pairs: t (P, d), frames (P, f, d), mask (P, f), vbar (P, d); float32.
    ``folded`` (optional) saves refolding psi's weights on every call."""
    psi = model.psi
    P, d = t.shape
    hd = d // psi.heads
    fw = folded or FoldedAttention(psi)
    h = psi.ln1(vbar - t)  # the semantic gap v̄ - t
    qk = torch.addmm(fw.b_qk, h, fw.w_qk.t()).view(P, psi.heads, d)
    c = psi.ln1(frames)
    logits = torch.einsum("phd,pfd->phf", qk, c) / math.sqrt(hd)
    if mask is not None and not getattr(model.cfg, "reference_padding", False):
        logits = logits.masked_fill(~mask.bool()[:, None, :], float("-inf"))
    w = logits.softmax(dim=-1)
    cbar = torch.einsum("phf,pfd->phd", w, c)
    x = psi.ln2(torch.addmm(fw.b_ov, cbar.reshape(P, psi.heads * d), fw.w_ov.t()))
    x = psi.ln3(x + psi.drop(psi.ffn(x)))
    delta = psi.mu(x)
    pl = torch.einsum("pd,pfd->pf", t, frames) / model.cfg.temp  # text-conditioned pooling over the real frames
    if mask is not None:
        pl = pl.masked_fill(~mask.bool(), float("-inf"))
    p = torch.einsum("pf,pfd->pd", pl.softmax(dim=-1), frames)
    return F.cosine_similarity(t + delta, p, dim=-1, eps=1e-8)


def fused_pair_scorer(model: Any, queries: np.ndarray, frames: Any, masks: Any, units: Any, norms: Any,
                      *, chunk: int = 4096) -> Callable[[np.ndarray, np.ndarray], torch.Tensor]:
    """(query idx (P,), rows (P,)) -> fused psi scores (P,) float32 over index arrays (frames (n, f, d) float16,
    masks (n, f), v̄ = norms * units); pairs scored in row order (sequential memmap reads)."""
    dev = model.device
    q_all = torch.as_tensor(np.asarray(queries, dtype=np.float32)).to(dev)
    folded = FoldedAttention(model.psi)

    def score(qi: np.ndarray, rows: np.ndarray) -> torch.Tensor:
        qi, rows = np.asarray(qi, dtype=np.int64).reshape(-1), np.asarray(rows, dtype=np.int64).reshape(-1)
        order = np.argsort(rows, kind="stable")
        out = np.empty(rows.shape[0], dtype=np.float32)
        with torch.inference_mode():
            for s in range(0, rows.shape[0], chunk):
                sel = order[s:s + chunk]
                uniq, inv = np.unique(rows[sel], return_inverse=True)
                back = torch.from_numpy(inv).to(dev)
                fr = torch.from_numpy(np.asarray(frames[uniq], dtype=np.float32)).to(dev)[back]
                mk = torch.from_numpy(np.asarray(masks[uniq])).to(dev)[back]
                vb = np.asarray(units[uniq], dtype=np.float32) * np.asarray(norms[uniq], dtype=np.float32)[:, None]
                tq = q_all[torch.from_numpy(qi[sel]).to(dev)]
                out[sel] = fused_pair_scores(model, tq, fr, mk, torch.from_numpy(vb).to(dev)[back], folded).float().cpu().numpy()
        return torch.from_numpy(out)

    return score


def fused_exhaustive(model: Any, version: Any, t: torch.Tensor, *, block: int = 8192) -> np.ndarray:
    """Fused psi scores (a, n) of every entry of ``version`` (anything with n, frames, masks, units, norms) for
    each query, query by query in blocks of entries: the exhaustive search before the fold."""
    n, a = version.n, t.shape[0]
    out = np.empty((a, n), dtype=np.float32)
    dev = t.device
    folded = FoldedAttention(model.psi)
    with torch.inference_mode():
        for s0 in range(0, n, block):
            s1 = min(n, s0 + block)
            fr = torch.from_numpy(np.array(version.frames[s0:s1])).to(dev).float()
            mk = torch.from_numpy(np.array(version.masks[s0:s1])).to(dev)
            vb = torch.from_numpy(np.asarray(version.units[s0:s1], dtype=np.float32)
                                  * np.asarray(version.norms[s0:s1], dtype=np.float32)[:, None]).to(dev)
            for i in range(a):
                ti = t[i : i + 1].float().expand(s1 - s0, -1)
                out[i, s0:s1] = fused_pair_scores(model, ti, fr, mk, vb, folded).cpu().numpy()
    return out
