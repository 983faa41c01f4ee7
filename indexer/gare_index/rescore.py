"""Exact re-scoring of an approximate shortlist: the float vectors by id (:class:`VectorStore`, a memmap base plus rows
added later) and the top k of each query's shortlist by exact inner product (:func:`rescore`), as IVF-PQ answers.

The dot products are numpy's own einsum loops over each unique row once, not a BLAS product, and the top k is a
partial sort on one exact integer key per candidate (:func:`rank_keys`: score, then shortlist position), so ties
come out as a stable full sort would order them.
"""

from __future__ import annotations

import numpy as np

from gare_index.ann_params import as_f32

__all__ = ["VectorStore", "rescore", "rank_keys"]


class VectorStore:
    """id -> float32 vector for exact re-scoring: a base array (memmap ok) plus rows added later."""

    def __init__(self, base: np.ndarray | None, base_ids: np.ndarray | None) -> None:
        self.base = base
        self.d = None if base is None else base.shape[1]
        if base is not None and base_ids is not None:
            base_ids = np.asarray(base_ids, dtype=np.int64)
            if base_ids.shape != (base.shape[0],):
                raise ValueError(f"vector_ids must be ({base.shape[0]},), got {base_ids.shape}")
            order = np.argsort(base_ids, kind="stable")
            self._base_sorted, self._base_rows = base_ids[order], order
        else:
            self._base_sorted = self._base_rows = None
        self._extra_ids = np.zeros(0, dtype=np.int64)  # sorted
        self._extra_vecs = np.zeros((0, self.d or 0), dtype=np.float32)

    @property
    def available(self) -> bool:
        return self.base is not None or self._extra_ids.size > 0

    def add(self, vectors: np.ndarray, ids: np.ndarray) -> None:
        vectors = as_f32(vectors)
        if self.d is None:
            self.d = vectors.shape[1]
            self._extra_vecs = np.zeros((0, self.d), dtype=np.float32)
        keep = ~np.isin(self._extra_ids, ids)  # a re-added id replaces its previous vector
        all_ids = np.concatenate([self._extra_ids[keep], ids.astype(np.int64)])
        all_vecs = np.concatenate([self._extra_vecs[keep], vectors])
        order = np.argsort(all_ids, kind="stable")
        self._extra_ids, self._extra_vecs = all_ids[order], all_vecs[order]

    @staticmethod
    def _find(sorted_ids: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if sorted_ids.size == 0:
            return np.zeros(ids.shape, dtype=bool), np.zeros(ids.shape, dtype=np.int64)
        pos = np.clip(np.searchsorted(sorted_ids, ids), 0, sorted_ids.size - 1)
        return sorted_ids[pos] == ids, pos

    def scores(self, ids: np.ndarray, q: np.ndarray) -> np.ndarray:
        """Exact inner products (b, kk) float32 of each query row ``q[i]`` (b, d) with the vectors of ``ids[i]``
        (b, kk); -inf where an id is missing.  Each query's base rows are read once each (sorted, memmap friendly); the dot
        products are numpy's own einsum loops, not BLAS: a (u, d) @ (d, 1) product through a multi-threaded BLAS
        waits for its threads on a busy machine, where a single-threaded loop over the few rows does not."""
        b, kk = ids.shape
        flat = ids.reshape(-1)
        out = np.full(flat.shape[0], -np.inf, dtype=np.float32)
        qrow = np.repeat(np.arange(b), kk)  # (b * kk,) the query of each candidate
        in_extra, pos, ok, rows = self._locate(flat)
        if in_extra.any():
            out[in_extra] = np.einsum("md,md->m", self._extra_vecs[pos[in_extra]], q[qrow[in_extra]])
        out = out.reshape(b, kk)
        ok, rows = ok.reshape(b, kk), rows.reshape(b, kk)
        for i in range(b):  # query by query: (kk, d) rows at a time, never a (b * kk, d) copy
            if ok[i].any():
                uniq, inv = np.unique(rows[i][ok[i]], return_inverse=True)
                vecs = np.asarray(self.base[uniq], dtype=np.float32)  # (u, d), u <= kk
                out[i][ok[i]] = np.einsum("ud,d->u", vecs, q[i])[inv]
        return out

    def _locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Where each id (m,) lives: (in the added rows, its position there, in the base and not added, its base row)."""
        in_extra, pos = self._find(self._extra_ids, ids)
        ok = np.zeros(ids.shape[0], dtype=bool)
        rows = ids
        if self.base is not None:
            need = ~in_extra & (ids >= 0)
            if self._base_sorted is None:
                ok = need & (ids < self.base.shape[0])
            else:
                hit, p = self._find(self._base_sorted, ids)
                ok = need & hit
                rows = np.where(hit, self._base_rows[p], 0)
        return in_extra, pos, ok, rows


def rescore(store: VectorStore, q: np.ndarray, cand: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The top k of ``cand`` (nq, kk) by exact inner product with ``q`` (nq, d): (scores, ids) (nq, k); ties
    keep the shortlist's order."""
    nq, kk = cand.shape
    d = q.shape[1]
    out_s = np.full((nq, k), -np.inf, dtype=np.float32)
    out_i = np.full((nq, k), -1, dtype=np.int64)
    step = max(1, (1 << 24) // max(1, kk * d))  # ~64 MB of gathered float32 vectors per block
    for s in range(0, nq, step):
        e = min(nq, s + step)
        c = cand[s:e]
        sc = store.scores(c, q[s:e])
        sc[c < 0] = -np.inf
        kept = min(k, kk)
        key = rank_keys(sc)  # (b, kk) int64: ascending = (score desc, shortlist position)
        if kk > kept:  # the k best by a partial sort: O(kk + k log k)
            key = np.partition(key, kept - 1, axis=1)[:, :kept]
        sel = np.sort(key, axis=1) & 0xFFFFFFFF  # shortlist positions in rank order
        sel_s = np.take_along_axis(sc, sel, 1)
        sel_i = np.take_along_axis(c, sel, 1)
        sel_i[~np.isfinite(sel_s)] = -1
        out_s[s:e, :kept] = sel_s
        out_i[s:e, :kept] = sel_i
    return out_s, out_i


def rank_keys(sc: np.ndarray) -> np.ndarray:
    """int64 keys (b, kk) whose ascending order is (score descending, column ascending) for float32 scores (b, kk):
    the order-preserving integer of -score (its IEEE bits, negatives' magnitude bits flipped) in the high 32 bits,
    the column in the low 32 -- one exact key, so a partial sort keeps the ties a stable full sort would."""
    neg = np.ascontiguousarray(-(sc.astype(np.float32) + np.float32(0.0)))  # + 0.0: -0.0 and 0.0 tie, as in compares
    bits = neg.view(np.int32)
    ordered = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).astype(np.int64)  # monotone in -score
    return (ordered << 32) | np.arange(sc.shape[1], dtype=np.int64)[None, :]
