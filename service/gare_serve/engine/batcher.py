"""Micro-batching: concurrent requests share one forward pass.

An asyncio queue collects work items; a collector task takes the first waiting item, then keeps taking
items until ``max_batch`` are gathered or ``max_wait_s`` has passed since the first one, and hands the
batch to ONE worker thread (``process(items) -> results``, same order). While the worker runs, new
requests pile up in the queue and form the next batch, so batches grow with the load on their own.
With ``adaptive_wait`` (default) the collector waits for company only when the previous batch had more
than one item: a lone client never pays ``max_wait_s``, concurrent clients share the text encoder and
the rerank.

The worker is a single thread on purpose: torch already uses every core inside one call, and one
thread means the model is never run twice at the same time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


class BatcherClosed(RuntimeError):
    pass


class BatcherOverloaded(RuntimeError):
    pass


@dataclass
class _Pending(Generic[T]):
    item: T
    future: asyncio.Future
    enqueued: float = field(default_factory=time.perf_counter)


@dataclass
class BatchInfo:
    """Attached to each result by :class:`MicroBatcher`: how the item was batched."""

    size: int
    queue_s: float  # enqueue -> batch start
    run_s: float  # the worker's time for the whole batch


class MicroBatcher(Generic[T, R]):
    def __init__(
        self,
        process: Callable[[Sequence[T]], Sequence[R]],
        *,
        max_batch: int = 32,
        max_wait_s: float = 0.002,
        max_queue: int = 1024,
        name: str = "batcher",
        on_batch: Callable[[int], Any] | None = None,
        adaptive_wait: bool = True,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
        self.process = process
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self.max_queue = max_queue
        self.name = name
        self.on_batch = on_batch
        self._queue: asyncio.Queue[_Pending[T] | None] | None = None
        self._task: asyncio.Task | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._closed = False
        self.adaptive_wait = adaptive_wait
        self._last_batch = 0
        self.batches = 0
        self.items = 0

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self._task is not None:
            return
        self._queue = asyncio.Queue()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self.name)
        self._closed = False
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"{self.name}-collector")

    async def stop(self) -> None:
        """Finish what is queued, then stop the collector and the worker thread."""
        if self._task is None:
            return
        self._closed = True
        assert self._queue is not None
        await self._queue.put(None)
        try:
            await self._task
        finally:
            self._task = None
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._closed

    @property
    def queued(self) -> int:
        return 0 if self._queue is None else self._queue.qsize()

    # ---------------------------------------------------------------- use
    async def submit(self, item: T) -> tuple[R, BatchInfo]:
        """Queue one item and wait for its result (exceptions of the batch are raised here)."""
        if self._task is None or self._closed or self._queue is None:
            raise BatcherClosed(f"{self.name} is not running")
        if self._queue.qsize() >= self.max_queue:
            raise BatcherOverloaded(f"{self.name}: {self._queue.qsize()} queries are already waiting")
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        await self._queue.put(_Pending(item, fut))
        return await fut

    async def submit_many(self, items: Sequence[T]) -> list[tuple[R, BatchInfo]]:
        return list(await asyncio.gather(*(self.submit(it) for it in items)))

    # ---------------------------------------------------------------- collector
    async def _collect(self, first: _Pending[T]) -> tuple[list[_Pending[T]], bool]:
        assert self._queue is not None
        batch = [first]
        stop = False
        # Wait for company only when the last batch had some: a lone client pays no wait, while under
        # load the queue fills during each run anyway and the wait only tops the batch up.
        wait = self.max_wait_s if self._last_batch > 1 or not self.adaptive_wait else 0.0
        deadline = time.perf_counter() + wait
        while len(batch) < self.max_batch:
            try:
                nxt = self._queue.get_nowait()
            except asyncio.QueueEmpty:
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    break
                try:
                    nxt = await asyncio.wait_for(self._queue.get(), remaining)
                except TimeoutError:
                    break
            if nxt is None:
                stop = True
                break
            batch.append(nxt)
        return batch, stop

    async def _run(self) -> None:
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        stop = False
        while not stop:
            first = await self._queue.get()
            if first is None:
                break
            batch, stop = await self._collect(first)
            live = [p for p in batch if not p.future.done()]  # a cancelled request needs no work
            self._last_batch = len(live)
            if not live:
                continue
            start = time.perf_counter()
            try:
                results = await loop.run_in_executor(self._executor, self.process, [p.item for p in live])
                if len(results) != len(live):
                    raise RuntimeError(f"{self.name}: process returned {len(results)} results for {len(live)} items")
            except BaseException as e:  # noqa: BLE001 - every waiter gets the error
                for p in live:
                    if not p.future.done():
                        p.future.set_exception(e)
                if isinstance(e, asyncio.CancelledError):
                    raise
                continue
            run_s = time.perf_counter() - start
            self.batches += 1
            self.items += len(live)
            if self.on_batch is not None:
                self.on_batch(len(live))
            for p, r in zip(live, results, strict=True):
                if not p.future.done():
                    p.future.set_result((r, BatchInfo(len(live), start - p.enqueued, run_s)))
        # drain anything left after stop
        while not self._queue.empty():
            p = self._queue.get_nowait()
            if p is not None and not p.future.done():
                p.future.set_exception(BatcherClosed(f"{self.name} stopped"))
