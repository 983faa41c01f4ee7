"""gare.build_once: the compiled kernels' lazy build runs exactly once, however many threads race for it."""

from __future__ import annotations

import threading
import time

from gare import psi_fold_cpu, psi_fold_cpu_queries
from gare.build_once import once


def test_racing_threads_build_once_and_share_the_value():
    calls = []

    def build() -> object:
        calls.append(1)
        time.sleep(0.05)  # long enough for every thread to arrive while the first is building
        return object()

    get = once(build)
    start = threading.Barrier(8)
    got: list[object] = []

    def worker() -> None:
        start.wait()
        got.append(get())

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(got) == 8 and all(g is got[0] for g in got)
    assert get() is got[0] and len(calls) == 1


def test_a_failed_build_is_retried():
    attempts = []

    def build() -> int:
        attempts.append(1)
        if len(attempts) == 1:
            raise RuntimeError("first build fails")
        return 7

    get = once(build)
    try:
        get()
    except RuntimeError:
        pass
    assert get() == 7 and get() == 7 and len(attempts) == 2


def test_the_rerank_kernels_are_built_once():
    assert psi_fold_cpu._kernel() is psi_fold_cpu._kernel()
    assert psi_fold_cpu_queries._kernel() is psi_fold_cpu_queries._kernel()
