"""psi's per-query vectors: `QueryVectors`, `fold_queries` (three vectors and seven scalars per text) and
the per-query cache of them, `QueryFoldCache`.

Names follow the derivation in :mod:`gare.psi_fold`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from gare import psi_fold_cpu, psi_fold_cpu_queries
from gare.psi import Psi
from gare.psi_fold_weights import PsiFold, as_fold

# Up to this many queries the CPU fold is one compiled call per row (gare.psi_fold_cpu_queries.fold_query_rows); a
# larger batch (exhaustive scoring, benchmarks) is one torch matrix product, faster there.
KERNEL_ROWS = 64


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
    d = fold.dim
    if dev.type == "cpu" and t.shape[0] <= KERNEL_ROWS and psi_fold_cpu.available():
        # one compiled call (u, sc) instead of ~12 torch ops: at one query their dispatch, not the (d, 2d + 3)
        # product, was most of the fold on a cold cache (bench/results/rerank_floor.md)
        u, sc = psi_fold_cpu_queries.fold_query_rows(t.detach().to(torch.float32).contiguous().numpy(), fw.query_map.numpy())
        return QueryVectors(u=torch.from_numpy(u), sc=torch.from_numpy(sc), wsc=fw.scalars, eps=fold.eps,
                            inv_temp=1.0 / float(temp), fingerprint=fold.fingerprint)
    with torch.no_grad():
        t = t.to(torch.float32)
        y = t @ fw.query_map  # (a, 2d + 3): u1, u2, t·k2, t·m0, t·m1
        u = torch.cat([t, y[:, : 2 * d]], dim=1).view(-1, 3, d)  # (a, 3, d) = [t, u1, u2]
        ct = t - t.mean(-1, keepdim=True)
        sc = torch.cat([torch.stack([t.pow(2).sum(-1), ct.pow(2).sum(-1), t.sum(-1)], dim=1), y[:, 2 * d :],
                        torch.zeros_like(t[:, :1])], dim=1)
    return QueryVectors(u=u, sc=sc, wsc=fw.scalars, eps=fold.eps, inv_temp=1.0 / float(temp),
                        fingerprint=fold.fingerprint)


@dataclass(frozen=True)
class FoldArrays:
    """A PsiFold's arrays the CPU query fold and kernel read, as read-only numpy (see `fold_arrays`)."""

    query_map: np.ndarray  # (d, 2d + 3) float32
    scalars: np.ndarray  # (4,) float32
    eps: np.ndarray  # (3,) float64


_FOLD_ARRAYS: OrderedDict[str, FoldArrays] = OrderedDict()  # psi fingerprint -> its arrays; a few checkpoints at most


def fold_arrays(fold: PsiFold) -> FoldArrays:
    """fold's query map, scalars and eps as read-only numpy on the CPU, made once per psi fingerprint: a
    request reads them without a tensor call (with the caches cold after stage 1 each tensor call costs more than
    the numpy work it wraps: bench/results/rerank_floor.md)."""
    got = _FOLD_ARRAYS.get(fold.fingerprint)
    if got is None:
        arrs = [np.ascontiguousarray(x.detach().to("cpu", torch.float32).numpy()) for x in (fold.query_map, fold.scalars)]
        arrs.append(np.asarray(fold.eps, np.float64))
        for a in arrs:
            a.flags.writeable = False
        got = FoldArrays(*arrs)
        with _FOLD_ARRAYS_LOCK:
            _FOLD_ARRAYS[fold.fingerprint] = got
            while len(_FOLD_ARRAYS) > 8:
                _FOLD_ARRAYS.popitem(last=False)
    return got


_FOLD_ARRAYS_LOCK = threading.Lock()


def _fold_kept(rows: torch.Tensor, fold: PsiFold, temp: float) -> QueryVectors:
    """`fold_queries` of CPU rows a cache keeps: in chunks of at most KERNEL_ROWS, so that each kept row has the
    bits the one-query fold (`QueryFoldCache.fold_one`) gives it. A larger batch in one call would take the torch
    product, whose rounding differs; the cached row would then make a query's psi scores depend on the batch that
    first met it. rows (a, d) -> QueryVectors (a rows)."""
    if rows.shape[0] <= KERNEL_ROWS:
        return fold_queries(rows, fold, temp)
    parts = [fold_queries(rows[i : i + KERNEL_ROWS], fold, temp) for i in range(0, rows.shape[0], KERNEL_ROWS)]
    p0 = parts[0]
    return QueryVectors(u=torch.cat([p.u for p in parts]), sc=torch.cat([p.sc for p in parts]), wsc=p0.wsc,
                        eps=p0.eps, inv_temp=p0.inv_temp, fingerprint=p0.fingerprint)


class QueryFoldCache:
    """The query side of the fold, kept per query text embedding (bounded LRU, thread-safe): a query met
    again (the service's query-embedding cache hands back the same t) skips its (d, 2d + 3) product.

    Keys are (psi fingerprint, temperature, the float32 bytes of t's row), and a kept row is what `fold_one`
    computes for it alone (`_fold_kept`), so a hit is exactly the vectors a miss would give, whatever batch
    first met the query. CPU tensors only; others go straight to `fold_queries`."""

    def __init__(self, max_entries: int = 4096) -> None:
        if max_entries < 0:
            raise ValueError(f"max_entries must be >= 0, got {max_entries}")
        self.max_entries = max_entries
        self._rows: OrderedDict[tuple[str, float, bytes], tuple[np.ndarray, np.ndarray]] = OrderedDict()  # u (3, d), sc (7,)
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._rows)

    def clear(self) -> None:
        """Forget every query (a benchmark timing the first meeting of a query; the counters restart too)."""
        with self._lock:
            self._rows.clear()
            self.hits = self.misses = 0

    def fold(self, t: torch.Tensor, psi: Psi | PsiFold, temp: float) -> QueryVectors:
        """`fold_queries(t, psi, temp)`, each row computed once while it stays cached."""
        fold = as_fold(psi)
        if self.max_entries == 0 or t.device.type != "cpu" or t.ndim != 2:
            return fold_queries(t, fold, temp)
        rows = t.detach().to(torch.float32).contiguous()
        tn = rows.numpy()  # keys from numpy rows: iterating a tensor costs a tensor per row
        keys = [(fold.fingerprint, float(temp), tn[i].tobytes()) for i in range(tn.shape[0])]
        with self._lock:
            got = [self._rows.get(k) for k in keys]
            for k, g in zip(keys, got, strict=True):
                if g is not None:
                    self._rows.move_to_end(k)
        miss = [i for i, g in enumerate(got) if g is None]
        self.hits += len(keys) - len(miss)
        self.misses += len(miss)
        if miss:
            q = _fold_kept(rows if len(miss) == len(keys) else rows[miss], fold, temp)
            qu, qs = q.u.numpy(), q.sc.numpy()
            with self._lock:
                for j, i in enumerate(miss):
                    got[i] = (qu[j], qs[j])
                    self._rows[keys[i]] = got[i]
                while len(self._rows) > self.max_entries:
                    self._rows.popitem(last=False)
            if len(miss) == len(keys):
                return q
        u = torch.from_numpy(np.stack([g[0] for g in got]))  # type: ignore[index]
        sc = torch.from_numpy(np.stack([g[1] for g in got]))  # type: ignore[index]
        return QueryVectors(u=u, sc=sc, wsc=fold.scalars, eps=fold.eps, inv_temp=1.0 / float(temp),
                            fingerprint=fold.fingerprint)

    def fold_one(self, t: np.ndarray, fold: PsiFold, temp: float) -> tuple[np.ndarray, np.ndarray]:
        """One query's vectors as numpy, the served rerank's path (no tensors): t (d,) float32 -> u (1, 3, d),
        sc (1, 7) read-only, as `fold` gives them for that row (the same cache)."""
        if t.ndim != 1 or t.dtype != np.float32 or t.shape[0] != fold.dim:
            raise ValueError(f"t must be float32 ({fold.dim},), got {t.dtype} {t.shape}")
        key = (fold.fingerprint, float(temp), t.tobytes())
        with self._lock:
            g = self._rows.get(key)
            if g is not None:
                self._rows.move_to_end(key)
        if g is not None:
            self.hits += 1
            return g[0][None], g[1][None]
        self.misses += 1
        u, sc = psi_fold_cpu_queries.fold_query_rows(t[None], fold_arrays(fold).query_map)
        u.flags.writeable = sc.flags.writeable = False  # shared by every request of this query: the kernel reads them as is
        if self.max_entries > 0:
            with self._lock:
                self._rows[key] = (u[0], sc[0])
                while len(self._rows) > self.max_entries:
                    self._rows.popitem(last=False)
        return u, sc
