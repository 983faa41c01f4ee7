"""How many result hits one worker holds at once: a weighted, first-come first-served async semaphore.

A search answer exists four times on its way out: the search's hits (``gare_search.search.Hit``), the rendered
models with their metadata, the JSON bytes, and the socket's buffer. For a k = 10 query that is a few KB; for a
batch of 64 queries at k = 1000 it is tens of MB, and sixty such batches arriving together all finish their
search and wait for rendering at the same time. The worker's heap then grows to that peak and the C allocator
keeps most of it after the answers are gone (bench/results/http_unread.md). Admitting requests by the hits they
can return bounds that peak by design: a request waits here, holding only its parsed body, until the hits in
flight leave room for its own; small queries pass at once while a flood of huge ones is served a few at a time.

One budget per event loop (an ``asyncio`` future is bound to its loop; tests run one app in several loops).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator

__all__ = ["HitBudget"]


class HitBudget:
    """At most ``capacity`` hits in flight; a request asking for more than the whole budget is admitted alone
    (its weight clamped to the capacity), so every request is served. Waiters are admitted in arrival order: a
    large request at the head is not overtaken for ever by a stream of small ones."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 hit, got {capacity}")
        self.capacity = capacity
        self.free = capacity
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    @property
    def waiting(self) -> int:
        """Requests waiting for room."""
        return sum(not f.done() for _, f in self._waiters)

    @contextlib.asynccontextmanager
    async def hold(self, hits: int) -> AsyncIterator[None]:
        """Hold room for ``hits`` (at least 1, at most the capacity) while the block runs."""
        need = max(1, min(int(hits), self.capacity))
        if not self._waiters and self.free >= need:
            self.free -= need
        else:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append((need, fut))
            try:
                await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():  # admitted just as it was cancelled: give the room back
                    self._release(need)
                else:  # still queued: leave the queue (it may have blocked those behind it)
                    self._waiters.remove((need, fut))
                    self._admit()
                raise
        try:
            yield
        finally:
            self._release(need)

    def _release(self, n: int) -> None:
        self.free += n
        self._admit()

    def _admit(self) -> None:
        while self._waiters and self._waiters[0][0] <= self.free:
            need, fut = self._waiters.popleft()
            if fut.done():  # cancelled while queued
                continue
            self.free -= need
            fut.set_result(None)
