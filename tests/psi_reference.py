"""Reference psi implementations the served fold is checked against (test helpers, not product code).

The search serves one rerank, the fold (:mod:`gare_search.rerank`). These are the other two ways to compute
the same score, kept only to test it:

* ``model``: ``model.score(t, F[rows], mask[rows], vbar=norms*units, kv=...)`` as the training code defines
  it, one query at a time (``kv`` from the index when it stores psi's K/V projections);
* ``fused``: the same algebra rearranged so the per-frame work is query side. psi's attention logits are
  ``q·(W_k c_f + b_k) = (W_kᵀ q)·c_f + const`` and its output is ``Σ_f w_f (W_v c_f + b_v) = W_v (Σ_f w_f c_f)
  + b_v`` (the weights sum to 1), so instead of projecting every one of the K·f candidate frames by W_k and W_v
  it projects K query rows. Pairs of different queries are computed in one pass.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

PAIR_CHUNK = 512  # pairs per fused chunk


class FoldedAttention:
    """psi's attention weights folded for the query-side computation (see the module docstring).

    W_qk[h] = W_k,hᵀ W_q,h and b_qk[h] = W_k,hᵀ b_q,h turn the gap h into the vector that is dotted with the
    normalised frames; W_ov[h] = W_o[:, h] W_v,h and b_ov = W_o b_v + b_o map the attention-weighted mean frame
    straight to psi's attention output. Computed on every call (a reference needs no cache).
    """

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
            self.b_ov = (psi.o.weight.detach().float() @ psi.v.bias.detach().float() + psi.o.bias.detach().float()).contiguous()


def fused_pair_scores(model: Any, t: torch.Tensor, frames: torch.Tensor, mask: torch.Tensor | None,
                      vbar: torch.Tensor) -> torch.Tensor:
    """s (P,) for P (text, video) pairs: t (P, d), frames (P, f, d), mask (P, f), vbar (P, d); float32.

    Equal to ``model.score`` on each pair. With ``model.cfg.reference_padding`` (imported checkpoints) psi
    attends over every row, padded ones too, as the authors' code does; the pooling masks padded rows either way.
    """
    psi = model.psi
    P, d = t.shape
    H = psi.heads
    hd = d // H
    fw = FoldedAttention(psi)
    h = psi.ln1(vbar - t)  # the semantic gap v̄ - t
    qk = torch.addmm(fw.b_qk, h, fw.w_qk.t()).view(P, H, d)  # W_kᵀ (W_q h + b_q); the q·b_k term is constant
    c = psi.ln1(frames)
    logits = torch.einsum("phd,pfd->phf", qk, c) / math.sqrt(hd)
    if mask is not None and not getattr(model.cfg, "reference_padding", False):
        logits = logits.masked_fill(~mask.bool()[:, None, :], float("-inf"))
    w = logits.softmax(dim=-1)
    cbar = torch.einsum("phf,pfd->phd", w, c)
    x = psi.ln2(torch.addmm(fw.b_ov, cbar.reshape(P, H * d), fw.w_ov.t()))
    x = psi.ln3(x + psi.drop(psi.ffn(x)))
    delta = psi.mu(x)
    pl = torch.einsum("pd,pfd->pf", t, frames) / model.cfg.temp
    if mask is not None:
        pl = pl.masked_fill(~mask.bool(), float("-inf"))
    p = torch.einsum("pf,pfd->pd", pl.softmax(dim=-1), frames)
    return F.cosine_similarity(t + delta, p, dim=-1, eps=1e-8)


def model_pair_scores(model: Any, t: torch.Tensor, frames: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """s (P,) for P (text, video) pairs by ``model.score`` (the training definition), one pair at a time."""
    fr = frames.to(t.device, torch.float32)
    mk = None if mask is None else mask.to(t.device)
    with torch.inference_mode():
        return torch.stack([model.score(t[i : i + 1].float(), fr[i : i + 1], None if mk is None else mk[i : i + 1])[0, 0]
                            for i in range(t.shape[0])])


def _vbar(version: Any, r: np.ndarray | slice) -> np.ndarray:
    return np.asarray(version.units[r], dtype=np.float32) * np.asarray(version.norms[r], dtype=np.float32)[:, None]


def _split(version: Any, cand_ids: Sequence[np.ndarray]) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    lists = [np.asarray(c, dtype=np.int64).reshape(-1) for c in cand_ids]
    offs = np.cumsum([0] + [c.size for c in lists])
    rows = version.rows(np.concatenate(lists)) if offs[-1] else np.zeros(0, np.int64)
    return lists, offs, rows


def psi_scores_fused(model: Any, version: Any, t: torch.Tensor, cand_ids: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The fused path over an index version, with the signature of ``gare_search.rerank.psi_scores``."""
    lists, offs, rows = _split(version, cand_ids)
    if offs[-1] == 0:
        return [np.zeros(0, np.float32) for _ in lists]
    dev = t.device
    pair_q = np.repeat(np.arange(len(lists)), [c.size for c in lists])
    order = np.argsort(rows, kind="stable")
    srows = rows[order]
    spair_q = torch.from_numpy(pair_q[order]).to(dev)
    scores = torch.empty(rows.shape[0], dtype=torch.float32)
    with torch.inference_mode():
        for s0 in range(0, rows.shape[0], PAIR_CHUNK):
            s1 = min(rows.shape[0], s0 + PAIR_CHUNK)
            r = srows[s0:s1]
            fr = torch.from_numpy(np.asarray(version.frames[r])).to(dev).to(torch.float32)
            mk = torch.from_numpy(np.asarray(version.masks[r])).to(dev)
            vb = torch.from_numpy(_vbar(version, r)).to(dev)
            scores[s0:s1] = fused_pair_scores(model, t.index_select(0, spair_q[s0:s1]).float(), fr, mk, vb).cpu()
    flat = np.empty(rows.shape[0], dtype=np.float32)
    flat[order] = scores.numpy()
    return [flat[a:b] for a, b in zip(offs[:-1], offs[1:], strict=True)]


def psi_scores_model(model: Any, version: Any, t: torch.Tensor, cand_ids: Sequence[np.ndarray]) -> list[np.ndarray]:
    """``model.score`` per query over an index version (the training definition), same signature."""
    lists, offs, rows = _split(version, cand_ids)
    dev = t.device
    uniq, inv = np.unique(rows, return_inverse=True)
    inv = inv.reshape(-1)
    frames = torch.from_numpy(np.asarray(version.frames[uniq])).to(dev)
    masks = torch.from_numpy(np.asarray(version.masks[uniq])).to(dev)
    vbar = torch.from_numpy(_vbar(version, uniq)).to(dev)
    kv_src = version.kv if hasattr(version, "kv") else None
    out = []
    with torch.inference_mode():
        for i, (s0, s1) in enumerate(zip(offs[:-1], offs[1:], strict=True)):
            if s1 == s0:
                out.append(np.zeros(0, np.float32))
                continue
            sel = torch.from_numpy(inv[s0:s1]).to(dev)
            kv = None
            if kv_src is not None:
                r = rows[s0:s1]
                kv = (torch.from_numpy(np.asarray(kv_src[0][r])), torch.from_numpy(np.asarray(kv_src[1][r])))
            s = model.score(t[i : i + 1], frames[sel], masks[sel], vbar=vbar[sel], kv=kv, block_videos=max(128, s1 - s0))
            out.append(s[0].float().cpu().numpy())
    return out


REFERENCES = {"fused": psi_scores_fused, "model": psi_scores_model}  # name -> psi_scores-like reference


def exhaustive_fused(model: Any, version: Any, t: torch.Tensor, *, block: int = 8192) -> np.ndarray:
    """psi scores of every gallery entry for each query (a, n) by the fused path, query by query."""
    n, a, dev = version.n, t.shape[0], t.device
    out = np.empty((a, n), dtype=np.float32)
    with torch.inference_mode():
        for s0 in range(0, n, block):
            s1 = min(n, s0 + block)
            fr = torch.from_numpy(np.array(version.frames[s0:s1])).to(dev).float()
            mk = torch.from_numpy(np.array(version.masks[s0:s1])).to(dev)
            vb = torch.from_numpy(_vbar(version, slice(s0, s1))).to(dev)
            for i in range(a):
                out[i, s0:s1] = fused_pair_scores(model, t[i : i + 1].float().expand(s1 - s0, -1), fr, mk, vb).cpu().numpy()
    return out


def fused_pair_scorer(model: Any, queries: np.ndarray, frames: Any, masks: Any, units: Any, norms: Any, *,
                      chunk: int = 4096):
    """A served-bias pair scorer (``(query idx (P,), rows (P,)) -> scores (P,)``, as
    ``gare_build.served_biases.fold_pair_scorer``) by the fused path; pairs scored in row order."""
    dev = model.device
    q_all = torch.as_tensor(np.asarray(queries, dtype=np.float32)).to(dev)

    def score(qi: np.ndarray, rows: np.ndarray) -> torch.Tensor:
        qi, rows = np.asarray(qi, dtype=np.int64).reshape(-1), np.asarray(rows, dtype=np.int64).reshape(-1)
        order = np.argsort(rows, kind="stable")
        out = np.empty(rows.shape[0], dtype=np.float32)
        with torch.inference_mode():
            for s in range(0, rows.shape[0], chunk):
                sel = order[s:s + chunk]
                uniq, inv = np.unique(rows[sel], return_inverse=True)
                ix = torch.from_numpy(inv).to(dev)
                fr = torch.from_numpy(np.asarray(frames[uniq], dtype=np.float32)).to(dev)[ix]
                mk = torch.from_numpy(np.asarray(masks[uniq])).to(dev)[ix]
                vb = np.asarray(units[uniq], dtype=np.float32) * np.asarray(norms[uniq], dtype=np.float32)[:, None]
                tq = q_all[torch.from_numpy(qi[sel]).to(dev)]
                out[sel] = fused_pair_scores(model, tq, fr, mk, torch.from_numpy(vb).to(dev)[ix]).float().cpu().numpy()
        return torch.from_numpy(out)

    return score
