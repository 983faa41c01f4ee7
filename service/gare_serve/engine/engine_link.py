"""An HTTP worker's connection to the shared engine (``engine=shared``): one Unix-socket connection per worker
carrying all of its requests at once, answers matched by request id (``gare_serve.engine.engine_wire``).

:class:`EngineLink` connects on first use and again after the engine restarted; a call the engine cannot answer
(not reachable, connection lost, no answer within ``engine_timeout_s``) raises
:class:`gare_serve.engine.engine_wire.EngineUnavailable`, which the app answers with 503 and its message. An error the
engine raised (a typed search error, a refused reload) is raised again here, so the routes map it as in process.
:func:`wait_for_engine` is the worker's start: it waits for the engine's description while the engine loads;
:func:`ping_engine` is the supervisor's liveness check.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import pickle
import time
from pathlib import Path
from typing import Any

from gare_serve.engine.engine_wire import (
    EngineUnavailable,
    engine_address,
    prove_and_check,
    read_engine_key,
    read_message,
    write_message,
)
from gare_serve.engine.prometheus import Metrics

log = logging.getLogger(__name__)

__all__ = ["EngineLink", "ping_engine", "wait_for_engine"]

_LOST = (asyncio.IncompleteReadError, ConnectionError, OSError, EOFError, pickle.UnpicklingError)
RETRY = "gare-serve restarts it: retry shortly"


async def _hello_once(run_dir: Path, timeout_s: float) -> dict[str, Any]:
    address, key = engine_address(run_dir), read_engine_key(run_dir)
    reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(str(address)), timeout_s)
    try:
        await asyncio.wait_for(prove_and_check(reader, writer, key), timeout_s)
        write_message(writer, (0, "hello", ()))
        await writer.drain()
        _, ok, value = await asyncio.wait_for(read_message(reader), timeout_s)
    finally:
        writer.close()
    if not ok:
        raise value
    return value


def wait_for_engine(run_dir: str | os.PathLike, wait_s: float, poll_s: float = 0.2) -> dict[str, Any]:
    """The engine's description (``gare_serve.engine.engine_server.EngineState.describe``), waiting up to ``wait_s``
    for the engine to listen (it loads the model first). Blocking: run it off the event loop."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return asyncio.run(_hello_once(Path(run_dir), 10.0))
        except (*_LOST, TimeoutError) as e:
            last = e
        if time.monotonic() >= deadline:
            raise EngineUnavailable(f"the search engine did not answer at {engine_address(run_dir)} within "
                                    f"{wait_s:g} s: {last}")
        time.sleep(poll_s)


def ping_engine(run_dir: str | os.PathLike, timeout_s: float) -> bool:
    """Whether the engine answers a hello within ``timeout_s`` (the supervisor's liveness check). Blocking."""
    try:
        asyncio.run(asyncio.wait_for(_hello_once(Path(run_dir), timeout_s), timeout_s))
        return True
    except (*_LOST, TimeoutError, RuntimeError):
        return False


class EngineLink:
    """This worker's connection to the engine in ``run_dir``, used from the worker's event loop (:meth:`call`;
    ``loop`` is that loop once the worker has started, for calls from its threads)."""

    def __init__(self, run_dir: str | os.PathLike, *, timeout_s: float, metrics: Metrics | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.address = engine_address(run_dir)
        self.timeout_s = float(timeout_s)
        self.metrics = metrics
        self.loop: asyncio.AbstractEventLoop | None = None
        self.info: dict[str, Any] | None = None  # the engine's last description (hello, status)
        self.up = False  # the last call reached the engine
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._lock: asyncio.Lock | None = None

    # ------------------------------------------------------------------ connection
    async def _ensure(self) -> None:
        if self._writer is not None:
            return
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._writer is not None:
                return
            try:
                key = read_engine_key(self.run_dir)
                reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(str(self.address)), self.timeout_s)
                await asyncio.wait_for(prove_and_check(reader, writer, key), self.timeout_s)
            except (*_LOST, TimeoutError) as e:
                self.up = False
                raise EngineUnavailable(f"the search engine is not reachable at {self.address} ({e}); {RETRY}") from None
            self._writer = writer
            self._reader_task = asyncio.get_running_loop().create_task(self._read_loop(reader, writer))
            before = (self.info or {}).get("pid")
            info = await self._send("hello", ())
            if before is not None and info.get("pid") != before:
                log.warning("worker %d: the search engine restarted (pid %s, was %s), serving %s", os.getpid(),
                            info.get("pid"), before, info.get("version"))
            self.info, self.up = info, True

    async def _read_loop(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                rid, ok, value = await read_message(reader)
                fut = self._pending.pop(rid, None)
                if fut is not None and not fut.done():
                    fut.set_result((ok, value))
        except _LOST as e:
            self._lost(writer, f"the connection ended ({type(e).__name__})")
        except asyncio.CancelledError:
            self._lost(writer, "this worker closed the connection")
            raise

    def _lost(self, writer: asyncio.StreamWriter, why: str) -> None:
        """Every request waiting on ``writer``'s connection fails with EngineUnavailable; the next call reconnects."""
        if self._writer is writer:
            self._writer = None
        self.up = False
        writer.close()
        pid = (self.info or {}).get("pid")
        err = EngineUnavailable(f"the search engine (pid {pid}) stopped answering: {why}; {RETRY}")
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(err)

    async def _send(self, op: str, args: tuple, timeout_s: float | None = None) -> Any:
        writer = self._writer
        if writer is None:
            raise EngineUnavailable(f"the search engine is not connected; {RETRY}")
        rid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        try:
            write_message(writer, (rid, op, args))
            await writer.drain()
        except _LOST as e:
            self._pending.pop(rid, None)
            self._lost(writer, f"sending failed ({e})")
            raise EngineUnavailable(f"the search engine is not reachable ({e}); {RETRY}") from None
        limit = self.timeout_s if timeout_s is None else timeout_s
        try:
            ok, value = await asyncio.wait_for(fut, limit)
        except TimeoutError:
            self._pending.pop(rid, None)
            raise EngineUnavailable(f"the search engine did not answer ({op}) within {limit:g} s") from None
        if not ok:
            raise value
        return value

    # ------------------------------------------------------------------ calls
    async def call(self, op: str, *args: Any, timeout_s: float | None = None) -> Any:
        """The engine's answer to ``op(*args)`` (its error raised again here; EngineUnavailable when none comes)."""
        self.loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        try:
            await self._ensure()
            value = await self._send(op, args, timeout_s)
        except EngineUnavailable:
            if self.metrics is not None:
                self.metrics.engine_unavailable.inc()
            raise
        self.up = True
        if self.metrics is not None:
            self.metrics.engine_roundtrip.labels(op).observe(time.perf_counter() - t0)
        return value

    async def close(self) -> None:
        task, self._reader_task = self._reader_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self.up = False
