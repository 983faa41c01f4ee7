"""The shared engine's process under ``gare-serve`` (``engine=shared``): when to run one (:func:`resolve_engine`),
starting, watching and stopping it (:class:`EngineProcess`), and the supervisor that keeps it alive beside the HTTP
workers (:func:`keep_engine`).

One engine per device: the engine process loads the model, the query encoder and the index version once
(``gare_serve.engine.engine_server``), and the HTTP workers, which load neither, send it their searches over a Unix
socket in the run directory (``gare_serve.engine.engine_wire``). The supervisor starts the engine before the
workers (its model loads while they import), restarts it when it dies or, once it has answered, stops answering (a
hello every few seconds, within ``engine_timeout_s``; the workers answer 503 meanwhile and reconnect by themselves),
stops the whole service when it cannot start (exit status 3, as for a worker), and stops it last, after the workers
have drained their requests. The engine also gets SIGTERM from the kernel when the
supervisor itself dies (``gare_serve.processes.worker_lifetime.die_with_parent``).

A module of its own, at import level: the engine process is spawned, so :func:`engine_main` must be importable.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from uvicorn.config import STARTUP_FAILURE

from gare.cli_logging import setup_cli_logging
from gare.model import resolve_device
from gare_serve.engine.engine_link import ping_engine
from gare_serve.engine.engine_server import engine_settings, run_engine
from gare_serve.engine.engine_wire import engine_address, engine_ready_pid, write_engine_key
from gare_serve.processes.worker_lifetime import die_with_parent
from gare_serve.settings import Settings

log = logging.getLogger(__name__)

__all__ = ["EngineProcess", "engine_main", "keep_engine", "resolve_engine"]

STOP_WAIT_S = 20  # the engine's own shutdown (finish its batch, write the query bank) before SIGKILL
PING_EVERY_S = 5.0  # the supervisor asks the engine for a hello this often


def resolve_engine(mode: str, device: str, workers: int) -> str:
    """``shared`` or ``in_process`` for the ``engine`` setting: auto = shared when ``device`` resolves to CUDA and
    there are several workers (one model and index on the GPU instead of one per worker), else in_process."""
    if mode in ("shared", "in_process"):
        return mode
    if mode != "auto":
        raise ValueError(f"engine must be auto, in_process or shared, got {mode!r}")
    return "shared" if workers > 1 and resolve_device(device).type == "cuda" else "in_process"


def engine_main(settings: Settings, run_dir: str, supervisor_pid: int) -> None:
    """The engine process (spawned): dies with its supervisor, logs like it, serves until SIGTERM."""
    die_with_parent(supervisor_pid)
    setup_cli_logging(settings.log_level == "debug", level=settings.log_level)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(run_engine(settings, run_dir))


class EngineProcess:
    """The engine of one ``gare-serve``: its settings (``gare_serve.engine.engine_server.engine_settings``), its run
    directory (socket and key) and the current process."""

    def __init__(self, settings: Settings, run_dir: str | os.PathLike, torch_threads: int | None = None,
                 workers: int = 1) -> None:
        self.run_dir = Path(run_dir)
        self.address = engine_address(self.run_dir)  # ValueError now when the path cannot be a Unix socket
        write_engine_key(self.run_dir)
        self.settings = engine_settings(settings, torch_threads, workers)
        self.process: Any = None
        self.starts = 0
        self.failed_to_start = False
        self._answered = False
        self._next_ping = 0.0
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def start(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no inherited CUDA or thread state
        self.process = ctx.Process(target=engine_main, args=(self.settings, str(self.run_dir), os.getpid()),
                                   name="gare-engine", daemon=False)
        self.process.start()
        self.starts += 1
        self._answered = False  # pinged only to see it answer until it has once (it loads the model first)
        self._next_ping = 0.0
        log.info("started the search engine [%d] (device %s)", self.process.pid, self.settings.device)

    def keep_alive(self) -> bool:
        """Restart the engine if it died, or if it has loaded and then stopped answering (a hello within
        ``engine_timeout_s``, asked every PING_EVERY_S); False when it failed to start (the service must stop).

        Loaded means it answered a hello once or marked itself ready in the run directory: the mark is what makes a
        hang caught even when every hello of the loading phase (short, so loading never blocks this loop long)
        missed, as on a loaded machine."""
        with self._lock:
            p = self.process
            if p is None:
                return True
            if p.is_alive():
                if time.monotonic() < self._next_ping:
                    return True
                loaded = self._answered or engine_ready_pid(self.run_dir) == p.pid
                answered = ping_engine(self.run_dir, self.settings.engine_timeout_s if loaded else 1.0)
                self._next_ping = time.monotonic() + PING_EVERY_S
                self._answered = self._answered or answered
                if answered or not loaded:  # fine, or still loading
                    return True
                log.error("the search engine [%d] did not answer within %g s; killing it", p.pid,
                          self.settings.engine_timeout_s)
                p.kill()
            p.join()
            if p.exitcode == STARTUP_FAILURE:
                log.error("the search engine [%d] failed to start (see its error above); stopping", p.pid)
                self.failed_to_start = True
                return False
            log.error("the search engine [%d] died (exit code %s); restarting it", p.pid, p.exitcode)
            self.start()
            return True

    def stop(self) -> None:
        """SIGTERM, its graceful stop, then SIGKILL; idempotent."""
        with self._lock:
            p, self.process = self.process, None
        if p is None or not p.is_alive():
            return
        p.terminate()
        p.join(STOP_WAIT_S)
        if p.is_alive():  # pragma: no cover - stuck past its shutdown
            p.kill()
            p.join()
        log.info("stopped the search engine [%d]", p.pid)


def keep_engine(base: type, engine: EngineProcess) -> type:
    """``base`` (uvicorn's ``Multiprocess``, or a subclass) that also runs ``engine``: started before the workers,
    restarted when it dies (checked at every liveness round, every half second), stopped after the workers."""

    class EngineSupervisor(base):  # type: ignore[misc, valid-type]
        def init_processes(self) -> None:
            engine.start()
            super().init_processes()

        def keep_subprocess_alive(self) -> None:
            if not self.should_exit.is_set() and not engine.keep_alive():
                self.should_exit.set()
                return
            super().keep_subprocess_alive()

        def join_all(self) -> None:
            super().join_all()  # the workers drained their requests, which needed the engine
            engine.stop()

    EngineSupervisor.__qualname__ = EngineSupervisor.__name__ = f"Engine{base.__name__}"
    return EngineSupervisor
