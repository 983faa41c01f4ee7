"""Give a serving process's freed heap back to the system after a burst of large answers.

A burst of large answers (sixty 64-query, k = 1000 batches at once) grows a worker's heap by their objects and
buffers; once they are gone glibc keeps most of those pages: free chunks between live small objects are returned
by ``malloc_trim``, never by ``free`` itself. Neither half alone was enough (bench/http_unread.py, 60 clients that
never read): a periodic trim cannot return a heap fragmented by the peak's live objects, and the hit budget
(``gare_serve.web.hit_budget``: few large answers in flight at once) lowers the peak but leaves its pages; with
both the worker returns to where it started (bench/results/http_unread.md). Fixing glibc's mmap threshold
instead (every large block mapped on its own) also returned the memory but slowed searching under load, since
each micro-batch's tensors were then mapped and faulted in anew.

:func:`trim_when_grown` runs in each worker's (and the shared engine's) event loop: every ``interval_s`` it reads
how many bytes the heap holds free (glibc ``mallinfo2().fordblks``), and only when that has grown by
``growth_bytes`` since the last trim does it call ``malloc_trim(0)``, in a thread (it holds the arenas' locks
while it walks them). Free bytes, not RSS: the RSS peaks while a burst's answers are alive, when a trim returns
nothing, and does not move when they are freed later; the free bytes grow exactly then.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import sys

__all__ = ["free_heap_bytes", "rss_bytes", "trim", "trim_when_grown"]

log = logging.getLogger(__name__)

GROWTH_BYTES = 8 * 1024 * 1024  # below this the heap is left as it is: a trim would return next to nothing


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None)  # the C library this process already runs on
    except OSError:
        return None


def trim() -> bool:
    """Return the free pages of every heap arena to the system (glibc ``malloc_trim(0)``). True when memory was
    released; False when none was, or where the C library has no such call (not glibc)."""
    malloc_trim = getattr(_libc(), "malloc_trim", None)
    if malloc_trim is None:
        return False
    malloc_trim.argtypes, malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(malloc_trim(0))


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def free_heap_bytes() -> int | None:
    """Bytes the heap's arenas hold free (glibc >= 2.33 ``mallinfo2().fordblks``); None without that call."""
    mallinfo2 = getattr(_libc(), "mallinfo2", None)
    if mallinfo2 is None:
        return None
    mallinfo2.argtypes, mallinfo2.restype = [], _MallInfo2
    return int(mallinfo2().fordblks)


def rss_bytes() -> int | None:
    """This process's resident set (bytes), from /proc/self/statm; None where there is no /proc."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


async def trim_when_grown(interval_s: float, growth_bytes: int = GROWTH_BYTES) -> None:
    """Forever (cancel to stop): every ``interval_s``, trim the heap when its free bytes have grown by
    ``growth_bytes`` since the lowest point seen after the last trim. Returns at once where the C library cannot
    tell (not glibc 2.33 or later)."""
    base = free_heap_bytes()
    if base is None:
        log.info("heap trim off: this C library has no mallinfo2")
        return
    while True:
        await asyncio.sleep(interval_s)
        free = free_heap_bytes() or 0
        if free - base < growth_bytes:
            base = min(base, free)
            continue
        before = rss_bytes() or 0
        released = await asyncio.to_thread(trim)
        log.debug("heap trim: %d MiB free in the heap, RSS %d -> %d MiB (%s)", free >> 20, before >> 20,
                  (rss_bytes() or 0) >> 20, "released" if released else "nothing")
        base = free_heap_bytes() or free  # the trimmed pages stay in the free lists: count growth from here
