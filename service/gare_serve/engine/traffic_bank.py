"""The adaptive query bank (NCL's limitations section): a bounded rolling queue of served query embeddings.

Opt-in (`GARE_QUERY_BANK_SIZE` > 0 and `GARE_QUERY_BANK_PATH`). It keeps the served text embeddings t only (as
the rerank scored them, |t| included: psi is not scale-invariant), never the query text, at most `size` of them (oldest dropped first), and writes them atomically to a float32 .npy file
(no pickle) every `flush_every` queries and at shutdown. `gare-index biases --from-traffic BANK.npy` then
recomputes the NCL biases from this bank mixed with the checkpoint's training queue, so the biases follow
the queries users actually send.

Privacy: the bank holds no text, but an embedding is a description of the query: with the model it can be
matched against candidate texts. Treat the file like query logs (access control, retention) or leave the
bank off. See docs/postprocessing.md.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import numpy as np

from gare.atomic import atomic_write

log = logging.getLogger(__name__)


class QueryBank:
    def __init__(self, size: int, dim: int, path: Path, flush_every: int = 1000) -> None:
        if size < 1:
            raise ValueError(f"query bank size must be >= 1, got {size}")
        self.size, self.dim, self.path, self.flush_every = size, dim, Path(path), max(1, flush_every)
        self._buf = np.zeros((size, dim), np.float32)
        self._n = 0  # filled rows
        self._ptr = 0  # next row to write
        self._since_flush = 0
        self._lock = threading.Lock()
        if self.path.exists():
            self._load()

    def _load(self) -> None:
        try:
            old = np.load(self.path, allow_pickle=False)
        except (OSError, ValueError) as e:
            log.warning("query bank %s is unreadable (%s); starting empty", self.path, e)
            return
        if old.ndim != 2 or old.shape[1] != self.dim or old.dtype != np.float32:
            log.warning("query bank %s has shape %s %s, expected (n, %d) float32; starting empty", self.path, old.shape, old.dtype, self.dim)
            return
        old = old[-self.size:]
        self._buf[: len(old)] = old
        self._n = len(old)
        self._ptr = len(old) % self.size
        log.info("query bank: %d embeddings loaded from %s", self._n, self.path)

    def push(self, rows: np.ndarray) -> None:
        """rows (q, d): the embeddings t of served queries (banks written before |t| was kept hold unit rows; the
        readers give those a norm, gare_build.ncl_queues.served_norms)."""
        rows = np.asarray(rows, dtype=np.float32)[-self.size:]
        if rows.ndim != 2 or rows.shape[1] != self.dim:
            raise ValueError(f"query bank expects (q, {self.dim}) embeddings, got {rows.shape}")
        flush = False
        with self._lock:
            idx = (self._ptr + np.arange(len(rows))) % self.size
            self._buf[idx] = rows
            self._ptr = int((self._ptr + len(rows)) % self.size)
            self._n = min(self.size, self._n + len(rows))
            self._since_flush += len(rows)
            if self._since_flush >= self.flush_every:
                self._since_flush = 0
                flush = True
        if flush:
            self.flush()

    def snapshot(self) -> np.ndarray:
        """The bank, oldest first: (n, d)."""
        with self._lock:
            if self._n < self.size:
                return self._buf[: self._n].copy()
            return np.concatenate([self._buf[self._ptr:], self._buf[: self._ptr]])

    def __len__(self) -> int:
        return self._n

    def flush(self) -> None:
        data = self.snapshot()
        self.path.parent.mkdir(parents=True, exist_ok=True)

        def write(tmp: str) -> None:
            with open(tmp, "wb") as fh:
                np.save(fh, data, allow_pickle=False)

        atomic_write(self.path, write)  # temp file, fsync, os.replace, fsync the folder
        log.info("query bank: %d embeddings written to %s", len(data), self.path)
