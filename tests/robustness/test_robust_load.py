"""Load against a real `gare-serve` process on 127.0.0.1 (tests/robustness/load.py): the rated concurrency holds with
zero 5xx and zero dropped requests, resident memory stays flat, and index reloads under load fail no request.

Fast (CI): a burst of 4000 requests (RSS sampled every 0.25 s: the memory-growth check) and ~6 s of reloads
under load. Slow (`-m slow`, `python -m bench.robustness --full`):
several minutes of load (GARE_ROBUST_LOAD_S, default 240) and a minute of reloads every second.
"""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest

from tests.robustness import load as LT
from tests.robustness.test_robust_common import (
    LIVE_KEY,
    index_contents,
    record,
)

KEY = LIVE_KEY
RATED_CLIENTS = 16  # the concurrency the service is rated for on this 2-core CPU (docs/robustness.md)


@pytest.fixture(scope="module")
def server(live_env):
    # gare-serve on 127.0.0.1, shared with the other robustness tests of this run
    yield live_env["srv"], live_env["index"], live_env["lib"]


def _load_figures(res, mode: str) -> dict:
    d = res.to_dict()
    d["mode"] = mode
    d["rated_clients"] = RATED_CLIENTS
    return d


def test_load_burst_holds(server):
    srv, _, _ = server
    # bounded by a request count (a few thousand), not by time, so the memory check sees the same work on a
    # loaded machine; the time cap only stops a run that would hang
    res = LT.run_load(srv.base_url, clients=RATED_CLIENTS, duration_s=180.0, max_requests=4000, pid=srv.proc.pid,
                      rss_interval_s=0.25)
    record("load_fast", _load_figures(res, "fast"))
    print(res.summary())
    # the memory-growth check: RSS of the real uvicorn process sampled over the whole burst (thousands of
    # requests), first vs last window (bounds in assert_load_held)
    assert res.rss.get("growth_mib") is not None and len(res.rss.get("samples", [])) >= 8, res.rss
    assert res.sent >= 2000, res.sent
    LT.assert_load_held(res)
    assert srv.proc.poll() is None


def _reloader(idx, lib, base_url, period_s: float, results: list):
    """Write a new index version (remove one video, then build the library again) and reload, until stopped."""
    from gare_build.build import BuildOptions, build, remove

    victim = sorted(lib.glob("*.mp4"))[-1]

    def during(stop: threading.Event) -> dict:
        with httpx.Client(base_url=base_url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as c:
            while not stop.is_set():
                t = time.monotonic()
                if str(victim.absolute()) in index_contents(idx)["paths"]:
                    remove(str(idx), [str(victim.absolute())])
                else:
                    build(None, str(lib), str(idx), BuildOptions(workers=0, progress=False))
                want = index_contents(idx)
                r = c.post("/v1/admin/reload")
                results.append({"status": r.status_code, "body": r.json(), "want": want["version"], "n": want["n"]})
                stop.wait(max(0.0, period_s - (time.monotonic() - t)))
        return {"reloads": len(results), "failed_reloads": sum(r["status"] != 200 for r in results)}

    return during


def _check_reloads(res, results):
    assert len(results) >= 2, results
    for r in results:
        assert r["status"] == 200, r
        # the admin reload answers with the new version; it may find the service already there, because every
        # worker also follows CURRENT by itself (index_poll_s): then reloaded is False and previous is the new one
        b = r["body"]
        switched = b["reloaded"] is True or b["previous"] == r["want"]
        assert switched and b["version"] == r["want"] and b["n"] == r["n"], r
    assert len(res.index_versions) >= 2, res.index_versions  # requests were answered from several versions


def test_reload_under_load_fails_no_request(server):
    srv, idx, lib = server
    results: list = []
    res = LT.run_load(srv.base_url, clients=8, duration_s=6.0, pid=srv.proc.pid,
                      during=_reloader(idx, lib, srv.base_url, 1.0, results))
    record("reload_under_load_fast", {**res.to_dict(), "reloads": len(results), "mode": "fast",
                                      "reload_status": [r["status"] for r in results]})
    LT.assert_load_held(res)
    _check_reloads(res, results)
    assert "error" not in res.during, res.during


@pytest.mark.slow
def test_load_sustained_holds(server):
    srv, _, _ = server
    duration = float(os.environ.get("GARE_ROBUST_LOAD_S", "240"))
    res = LT.run_load(srv.base_url, clients=RATED_CLIENTS, duration_s=duration, max_requests=5_000_000,
                      pid=srv.proc.pid, rss_interval_s=1.0)
    record("load_full", _load_figures(res, "full"))
    print(res.summary())
    LT.assert_load_held(res)
    # flat memory: the last minute's median RSS within 5% (or 32 MiB) of the first minute's
    r = res.rss
    assert r["growth_mib"] <= max(32.0, 0.05 * r["first_window_median_mib"]), r


@pytest.mark.slow
def test_reload_under_load_sustained(server):
    srv, idx, lib = server
    results: list = []
    res = LT.run_load(srv.base_url, clients=RATED_CLIENTS, duration_s=60.0, pid=srv.proc.pid,
                      during=_reloader(idx, lib, srv.base_url, 1.0, results))
    record("reload_under_load_full", {**res.to_dict(), "reloads": len(results), "mode": "full",
                                      "reload_status": [r["status"] for r in results]})
    LT.assert_load_held(res)
    _check_reloads(res, results)


def test_load_refuses_non_loopback_targets():
    for url in ("http://10.0.0.1:8000", "http://example.com", "http://0.0.0.0:80", "http://192.168.1.2"):
        with pytest.raises(ValueError, match="loopback"):
            LT.check_loopback(url)
    for url in ("http://127.0.0.1:8000", "http://localhost:1", "http://[::1]:9"):
        assert LT.check_loopback(url) == url
