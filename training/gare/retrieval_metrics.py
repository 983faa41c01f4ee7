"""Retrieval metrics (SPEC section 7): R@1/5/10/50, median and mean rank, both directions, multi-caption aware.

Light module: numpy + torch only.

Ranks are 1-based and tie-free in the standard "strictly greater" sense:

* text-to-video: ``rank_i = 1 + #{videos j' : sim[i, j'] > sim[i, gt(i)]}`` where ``gt(i) = text_video[i]``;
* video-to-text: a video's ground truth is *any* of its captions, so its rank is the minimum over its
  captions of the caption's rank in the video's column, which equals
  ``1 + #{texts i' : sim[i', j] > max_{i: gt(i) = j} sim[i, j]}``.  Videos without any caption have no
  defined rank and are left out of the video-to-text figures (``n`` reports how many were ranked).

Ties therefore count in the query's favour (a tied competitor does not push the ground truth down).  No
row is sorted: each block of rows (or columns) is compared against its ground-truth score, O(n_t n_v)
comparisons and O(block x n) memory, so 10k x 10k runs in well under a second.

``MdR`` is ``numpy.median`` of the ranks (may end in .5 for an even count), ``MnR`` the mean rank; R@k are
percentages.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch
from torch import Tensor

__all__ = ["RECALL_KS", "ranks_t2v", "ranks_v2t", "rank_summary", "retrieval_metrics", "format_table"]

RECALL_KS = (1, 5, 10, 50)


def _to_tensor(sim) -> Tensor:
    if isinstance(sim, Tensor):
        t = sim.detach()
    else:
        t = torch.from_numpy(np.ascontiguousarray(np.asarray(sim)))
    if t.ndim != 2:
        raise ValueError(f"sim must be 2-D (n_texts, n_videos), got shape {tuple(t.shape)}")
    if not t.is_floating_point():
        t = t.double()
    return t


def _check_tv(text_video, n_texts: int, n_videos: int) -> np.ndarray:
    tv = np.asarray(text_video).astype(np.int64, copy=False).reshape(-1)
    if tv.shape[0] != n_texts:
        raise ValueError(f"text_video has {tv.shape[0]} entries for {n_texts} texts")
    if tv.size and (tv.min() < 0 or tv.max() >= n_videos):
        raise ValueError(f"text_video indices must lie in [0, {n_videos})")
    return tv


def ranks_t2v(sim, text_video, *, block: int = 1024) -> np.ndarray:
    """1-based rank of each text's own video among all videos (1 + count of strictly higher scores)."""
    S = _to_tensor(sim)
    n_t, n_v = S.shape
    tv = torch.as_tensor(_check_tv(text_video, n_t, n_v), device=S.device)
    out = np.empty(n_t, dtype=np.int64)
    for s in range(0, n_t, block):
        e = min(n_t, s + block)
        rows = S[s:e]
        gt = rows.gather(1, tv[s:e, None])  # (b, 1)
        out[s:e] = ((rows > gt).sum(1) + 1).cpu().numpy()
    return out


def ranks_v2t(sim, text_video, *, block: int = 1024) -> np.ndarray:
    """1-based rank of each video's best caption among all texts; -1 for videos that have no caption."""
    S = _to_tensor(sim)
    n_t, n_v = S.shape
    tv = _check_tv(text_video, n_t, n_v)
    tv_t = torch.as_tensor(tv, device=S.device)
    # best ground-truth caption score per video: max over its captions of sim[i, tv[i]]
    own = S[torch.arange(n_t, device=S.device), tv_t]
    best = torch.full((n_v,), -math.inf, dtype=S.dtype, device=S.device)
    best = best.scatter_reduce(0, tv_t, own, reduce="amax", include_self=True)
    has_caption = np.bincount(tv, minlength=n_v) > 0
    out = np.full(n_v, -1, dtype=np.int64)
    for s in range(0, n_v, block):
        e = min(n_v, s + block)
        cols = S[:, s:e]  # (n_t, b)
        out[s:e] = ((cols > best[None, s:e]).sum(0) + 1).cpu().numpy()
    out[~has_caption] = -1
    return out


def rank_summary(ranks: np.ndarray) -> dict[str, float]:
    """R@1/5/10/50 (percent), MdR, MnR of 1-based ranks (entries < 1 are ignored: undefined ranks)."""
    r = np.asarray(ranks, dtype=np.float64)
    r = r[r >= 1]
    res: dict[str, float] = {}
    if r.size == 0:
        for k in RECALL_KS:
            res[f"R{k}"] = float("nan")
        res["MdR"] = res["MnR"] = float("nan")
        return res
    for k in RECALL_KS:
        res[f"R{k}"] = float(100.0 * np.mean(r <= k))
    res["MdR"] = float(np.median(r))
    res["MnR"] = float(np.mean(r))
    return res


def _normalisation_errors(S: Tensor, gamma: float) -> dict[str, float]:
    """NCL eq. 5 errors from a full similarity matrix (rescaled so the target is 1; see gare.sinkhorn)."""
    L = S.double() / gamma
    n_t, n_v = L.shape
    r_t2v = torch.softmax(L, dim=1).sum(0) * (n_v / n_t)  # per video
    r_v2t = torch.softmax(L, dim=0).sum(1) * (n_t / n_v)  # per text
    return {
        "t2v": float(torch.mean(torch.abs(1 - r_t2v))),
        "v2t": float(torch.mean(torch.abs(1 - r_v2t))),
    }


def retrieval_metrics(
    sim: Tensor | np.ndarray,
    text_video: np.ndarray,
    *,
    block: int = 1024,
    gamma: float | None = None,
) -> dict:
    """Text-to-video and video-to-text retrieval metrics of a (n_texts, n_videos) score matrix.

    ``text_video[i]`` is the column of text i's video.  Returns ``{"t2v": {R1, R5, R10, R50, MdR, MnR},
    "v2t": {...}}`` (R in percent).  With ``gamma`` set, also ``"norm_err": {"t2v": e, "v2t": e}``, NCL's
    eq. 5 normalisation errors of softmax(sim / gamma) (per-item sums rescaled by n_videos / n_texts, resp.
    n_texts / n_videos, so that the target is 1).
    """
    S = _to_tensor(sim)
    out: dict = {
        "t2v": rank_summary(ranks_t2v(S, text_video, block=block)),
        "v2t": rank_summary(ranks_v2t(S, text_video, block=block)),
    }
    if gamma is not None:
        out["norm_err"] = _normalisation_errors(S, gamma)
    return out


def _flatten(d: Mapping, prefix: str = "") -> dict[str, object]:
    flat: dict[str, object] = {}
    for k, v in d.items():
        key = f"{prefix} {k}".strip()
        if isinstance(v, Mapping):
            flat.update(_flatten(v, key))
        else:
            flat[key] = v
    return flat


def _fmt(v: object) -> str:
    if isinstance(v, bool) or v is None:
        return "" if v is None else str(v)
    if isinstance(v, int | np.integer):
        return str(int(v))
    if isinstance(v, float | np.floating):
        f = float(v)
        if math.isnan(f):
            return "-"
        return f"{f:.1f}" if abs(f) >= 0.1 or f == 0 else f"{f:.4f}"
    return str(v)


def format_table(rows: dict[str, dict]) -> str:
    """Markdown table: one row per name; nested dicts (e.g. retrieval_metrics output) become
    "t2v R1", "v2t MdR", ... columns in first-seen order.  Floats are shown with one decimal
    (four significant places below 0.1); a missing value is left blank."""
    flat = {name: _flatten(m) for name, m in rows.items()}
    cols: list[str] = []
    for m in flat.values():
        for k in m:
            if k not in cols:
                cols.append(k)
    header = "| method | " + " | ".join(cols) + " |"
    sep = "|---|" + "|".join("---:" for _ in cols) + "|"
    lines = [header, sep]
    for name, m in flat.items():
        lines.append(f"| {name} | " + " | ".join(_fmt(m.get(c)) for c in cols) + " |")
    return "\n".join(lines)
