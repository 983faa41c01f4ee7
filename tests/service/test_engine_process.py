"""The supervisor's liveness rule for the shared engine (``EngineProcess.keep_alive``), on real processes that stand in
for the engine: one that has loaded (marked itself ready) and then hangs is killed and replaced even when no hello of
its loading phase was answered; one still loading is left to load."""

from __future__ import annotations

import multiprocessing
import os
import time

from gare_serve.engine.engine_wire import mark_engine_ready
from gare_serve.processes.engine_process import EngineProcess
from gare_serve.settings import Settings


def _hangs(run_dir: str, ready: bool) -> None:
    """Alive, never listening: a loaded engine that hangs (ready) or one that is still loading (not ready)."""
    if ready:
        mark_engine_ready(run_dir)
    time.sleep(600)


class _StandIn(EngineProcess):
    """The real keep_alive over stand-in engine processes (starting a real engine would load a model)."""

    ready = True

    def start(self) -> None:
        ctx = multiprocessing.get_context("fork")
        self.process = ctx.Process(target=_hangs, args=(str(self.run_dir), self.ready), daemon=True)
        self.process.start()
        self.starts += 1
        self._answered = False
        self._next_ping = 0.0


def _engine(tmp_path, ready: bool) -> _StandIn:
    e = _StandIn(Settings(index=tmp_path, engine_timeout_s=0.5), tmp_path)
    e.ready = ready
    e.start()
    deadline = time.monotonic() + 60  # hang guard
    while ready and not (tmp_path / "engine.ready").exists():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return e


def _round(e: EngineProcess) -> bool:
    e._next_ping = 0.0  # the next liveness round pings now instead of PING_EVERY_S later
    return e.keep_alive()


def test_a_loaded_engine_that_never_answered_a_hello_is_killed_and_replaced(tmp_path):
    e = _engine(tmp_path, ready=True)
    first = e.process
    try:
        assert _round(e) is True
        first.join(60)
        assert first.exitcode == -9 and e.starts == 2 and e.process is not first and e.process.is_alive()
    finally:
        for p in (first, e.process):
            if p.is_alive():
                p.kill()


def test_an_engine_still_loading_is_left_to_load(tmp_path):
    e = _engine(tmp_path, ready=False)
    try:
        for _ in range(3):
            assert _round(e) is True
        assert e.process.is_alive() and e.starts == 1
    finally:
        e.process.kill()


def test_a_ready_mark_of_an_earlier_engine_does_not_count_for_a_new_one(tmp_path):
    (tmp_path / "engine.ready").write_text(str(os.getpid()))  # another process's mark
    e = _engine(tmp_path, ready=False)
    try:
        assert _round(e) is True and e.process.is_alive() and e.starts == 1
    finally:
        e.process.kill()

