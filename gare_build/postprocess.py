"""Index-side post-processing (SPEC §5-6): InvGC-corrected stage-1 vectors and NCL biases from a bank of
served queries (the NCL fold of stage 1 lives in :mod:`gare_index.ncl_ann`). See docs/postprocessing.md.

* **InvGC with LocalAdj** (``gare-index build --invgc``). ``G' = ½[norm(G − r_g S^g Ĝ) + norm(G − r_q S^q Q̂)]``
  with Ĝ, Q̂ the checkpoint's training video and query queues. The corrected vectors only feed stage 1
  (``ann_units.npy``, over which ``ann.faiss`` is built); ``units``/``norms`` keep v̄ for psi. LocalAdj
  centres the kept edge weights on their mean over the whole gallery; that mean is computed once, when the
  index is built (then the result equals :func:`gare.invgc.invgc` of the gallery), and recorded in the
  manifest, so that the correction of an item depends on nothing but the item: ``add`` corrects new videos
  with the recorded r_g, r_q and means, and ``remove`` only drops rows.
* **Biases from traffic** (``gare-index biases --from-traffic BANK.npy``): :func:`load_query_bank` validates
  a float32 (n, d) file of unit query embeddings (never unpickled), :func:`mix_queues` mixes it with the
  checkpoint's training queue.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gare.checkpoint import file_sha256

log = logging.getLogger(__name__)

TRAFFIC_SEED = 0
MAX_BANK_ROWS = 10_000_000  # a bank bigger than this is refused (the service keeps a bounded queue)


# ------------------------------------------------------------------------------------------ InvGC
def unit_tensor(x: Any):
    import torch
    import torch.nn.functional as F

    t = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(np.asarray(x, dtype=np.float32)))
    return F.normalize(t.float(), dim=-1)


def invgc_refs(ckpt: Any) -> tuple[Any, Any]:
    """(Ĝ, Q̂): the checkpoint's training video and query queues as unit float32 tensors."""
    qv, qt = ckpt.queues.get("video"), ckpt.queues.get("text")
    missing = [name for name, q in (("video", qv), ("text", qt)) if q is None or q.numel() == 0]
    if missing:
        raise ValueError(
            f"{ckpt.path}: InvGC needs the checkpoint's training queues (queues 'video' and 'text'); "
            f"missing: {missing} (checkpoints imported from the authors' code have none)"
        )
    return unit_tensor(qv.reshape(qv.shape[0], -1)), unit_tensor(qt.reshape(qt.shape[0], -1))


def _topk_rows(G, ref, kk: int, chunk: int):
    for i in range(0, G.shape[0], chunk):
        yield i, (G[i:i + chunk] @ ref.T).topk(kk, dim=1)


def invgc_means(gallery: Any, train_videos: Any, train_queries: Any, k_percent: float = 1.0,
                chunk: int = 4096) -> tuple[float, float]:
    """LocalAdj's centring constants: the mean of the kept (top k%) edge weights of the gallery against Ĝ and Q̂."""
    from gare.invgc import n_neighbours

    G = unit_tensor(gallery)
    out = []
    for ref in (train_videos, train_queries):
        ref = unit_tensor(ref)
        kk = n_neighbours(ref.shape[0], k_percent)
        total, count = 0.0, 0
        for _, top in _topk_rows(G, ref, kk, chunk):
            total += float(top.values.sum())
            count += top.values.numel()
        out.append(total / max(count, 1))
    return out[0], out[1]


def invgc_apply(gallery: Any, train_videos: Any, train_queries: Any, r_g: float, r_q: float, mean_g: float,
                mean_q: float, k_percent: float = 1.0, chunk: int = 4096) -> np.ndarray:
    """InvGC w/ LocalAdj with given centring constants: (n, d) unit float32. Row i depends only on row i.

    With the means from :func:`invgc_means` of the same gallery this is :func:`gare.invgc.invgc`."""
    import torch
    import torch.nn.functional as F

    from gare.invgc import n_neighbours

    G = unit_tensor(gallery)
    out = torch.empty_like(G)
    if G.shape[0] == 0:
        return out.numpy()
    Gh, Qh = unit_tensor(train_videos), unit_tensor(train_queries)
    kg, kq = n_neighbours(Gh.shape[0], k_percent), n_neighbours(Qh.shape[0], k_percent)
    with torch.no_grad():
        for i in range(0, G.shape[0], chunk):
            g = G[i:i + chunk]
            halves = []
            for ref, kk, r, mean in ((Gh, kg, r_g, mean_g), (Qh, kq, r_q, mean_q)):
                top = (g @ ref.T).topk(kk, dim=1)
                adj = torch.einsum("ck,ckd->cd", top.values - mean, ref[top.indices])
                halves.append(F.normalize(g - r * adj, dim=-1))
            out[i:i + chunk] = F.normalize(0.5 * (halves[0] + halves[1]), dim=-1)
    return np.ascontiguousarray(out.numpy(), dtype=np.float32)


# ------------------------------------------------------------------------------------------ traffic bank
def load_query_bank(path: str | os.PathLike, d: int, *, max_rows: int = MAX_BANK_ROWS) -> tuple[np.ndarray, dict[str, Any]]:
    """A validated bank of served query embeddings: float32 (n, d), finite, non-zero rows (re-normalised).

    Never unpickles (``allow_pickle=False``); any problem raises ValueError with the reason."""

    p = Path(path).expanduser().absolute()
    if not p.is_file():
        raise ValueError(f"--from-traffic {path}: no such file")
    try:
        arr = np.load(p, mmap_mode="r", allow_pickle=False)
    except ValueError as e:  # object arrays (pickles) and bad headers
        raise ValueError(f"--from-traffic {p}: not a plain numeric .npy array ({e})") from None
    except (OSError, EOFError) as e:
        raise ValueError(f"--from-traffic {p}: unreadable .npy file ({e})") from None
    if not isinstance(arr, np.ndarray):
        raise ValueError(f"--from-traffic {p}: an .npy array is expected, not an .npz archive")
    if arr.dtype != np.float32:
        raise ValueError(f"--from-traffic {p}: dtype {arr.dtype}, expected float32 (unit query embeddings)")
    if arr.ndim != 2 or arr.shape[1] != d:
        raise ValueError(f"--from-traffic {p}: shape {arr.shape}, expected (n, {d}) for this index (d={d})")
    n = int(arr.shape[0])
    if n == 0:
        raise ValueError(f"--from-traffic {p}: the bank is empty")
    if n > max_rows:
        raise ValueError(f"--from-traffic {p}: {n} rows, more than the {max_rows} accepted")
    x = np.array(arr, dtype=np.float32)
    if not np.all(np.isfinite(x)):
        bad = int((~np.isfinite(x)).any(axis=1).sum())
        raise ValueError(f"--from-traffic {p}: {bad} rows hold NaN or infinite values")
    norms = np.linalg.norm(x, axis=1)
    if np.any(norms < 1e-6):
        raise ValueError(f"--from-traffic {p}: {int((norms < 1e-6).sum())} rows are zero vectors")
    far = int((np.abs(norms - 1.0) > 1e-2).sum())
    if far:
        log.warning("%s: %d of %d query embeddings are not unit length; they are normalised", p, far, n)
    info = {"file": str(p), "sha256": file_sha256(p), "rows": n, "non_unit_rows": far}
    return (x / norms[:, None]).astype(np.float32), info


def _subsample(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    if k >= n:
        return np.arange(n)
    return np.sort(rng.choice(n, size=k, replace=False))


def mix_queues(train: np.ndarray | None, bank: np.ndarray, weight: float, *, seed: int = TRAFFIC_SEED
               ) -> tuple[np.ndarray, dict[str, Any]]:
    """The mixed query queue: a fraction `weight` of traffic queries, the rest from the training queue.

    Size: the training queue's (Q), or the bank's when there is no training queue. When the bank holds fewer
    than weight * Q rows, all of it is used and the training part shrinks so the fraction stays `weight`.
    Rows are subsampled without replacement by a seeded generator (same inputs, same queue)."""
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"--traffic-weight must be in [0, 1], got {weight}")
    rng = np.random.default_rng(seed)
    n_b = int(bank.shape[0])
    q = 0 if train is None else int(train.shape[0])
    if q == 0:
        n_t, n_q = n_b, 0
    else:
        n_t = int(round(weight * q))
        n_q = q - n_t
        if n_t > n_b:
            n_t = n_b
            n_q = min(q, int(round(n_b * (1.0 - weight) / weight))) if weight > 0 else q
    parts = []
    if n_q:
        assert train is not None
        parts.append(np.asarray(train, dtype=np.float32)[_subsample(q, n_q, rng)])
    if n_t:
        parts.append(bank[_subsample(n_b, n_t, rng)])
    mixed = np.concatenate(parts) if parts else np.zeros((0, bank.shape[1]), np.float32)
    info = {"traffic_weight": float(weight), "traffic_queries": n_t, "train_queries": n_q,
            "weight_effective": round(n_t / max(1, n_t + n_q), 6), "seed": seed}
    if q == 0:
        info["note"] = "the checkpoint has no training query queue: traffic queries only"
    return mixed, info


# ------------------------------------------------------------------------------------------ helpers for tests/bench
def coverage(reference_top: np.ndarray, candidates: np.ndarray, ks: Sequence[int]) -> dict[int, float]:
    """Share of each query's reference ids (q, top) inside its first K candidates (q, >= max ks), averaged."""
    out = {}
    ref = np.asarray(reference_top)
    for k in ks:
        c = np.asarray(candidates)[:, :k]
        hits = [np.isin(r, cc[cc >= 0]).mean() for r, cc in zip(ref, c, strict=True)]
        out[int(k)] = float(np.mean(hits)) if hits else math.nan
    return out


__all__ = [
    "invgc_refs", "invgc_means", "invgc_apply", "load_query_bank",
    "mix_queues", "coverage",
]

