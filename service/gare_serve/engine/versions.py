"""The served index version's lifetime: a reference-counted handle, so a reload swaps versions under requests.

Requests hold a reference to the version they started on (:class:`VersionHandle`); a reload retires the old
handle and it closes when its last request finishes. :func:`advise_random_access` tells the kernel how the
version's memmaps are read.
"""

from __future__ import annotations

import logging
import mmap
import threading

from gare_index.store import IndexVersion

log = logging.getLogger(__name__)

__all__ = ["VersionHandle", "advise_random_access"]


def advise_random_access(version: IndexVersion) -> None:
    """Tell the kernel the memmaps are read at random rows (the rerank gathers K scattered videos).

    Without it every page fault reads ahead ~128 KiB around a 12 KiB row: ~10x the I/O on a cold
    page cache, and the cache fills with rows nobody asked for.
    """
    if not hasattr(mmap, "MADV_RANDOM"):
        return
    for name in ("frames", "units", "keys", "values"):
        mm = getattr(getattr(version, name, None), "_mmap", None)
        if mm is not None:
            try:
                mm.madvise(mmap.MADV_RANDOM)
            except (OSError, ValueError):  # pragma: no cover - platform dependent
                pass


class VersionHandle:
    """Reference-counted owner of one open IndexVersion; closed once retired and unused."""

    def __init__(self, version: IndexVersion) -> None:
        self.version = version
        self._refs = 0
        self._retired = False
        self._closed = False
        self._lock = threading.Lock()

    def acquire(self) -> VersionHandle:
        with self._lock:
            self._refs += 1
        return self

    def release(self) -> None:
        with self._lock:
            self._refs -= 1
            close = self._retired and self._refs == 0 and not self._closed
            if close:
                self._closed = True
        if close:
            self._close()

    def retire(self) -> None:
        with self._lock:
            self._retired = True
            close = self._refs == 0 and not self._closed
            if close:
                self._closed = True
        if close:
            self._close()

    @property
    def refs(self) -> int:
        return self._refs

    @property
    def closed(self) -> bool:
        return self._closed

    def _close(self) -> None:
        try:
            self.version.close()
            log.info("closed index version %s", self.version.name)
        except Exception:  # noqa: BLE001 - closing must never fail a request
            log.exception("closing index version %s failed", getattr(self.version, "name", "?"))
