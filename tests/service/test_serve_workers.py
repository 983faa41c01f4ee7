"""`gare-serve --workers 2`: two real uvicorn worker processes behind one port, driven over HTTP."""

from __future__ import annotations

import concurrent.futures as cf
import json
import re

import httpx
import pytest

from gare_serve.engine.worker_board import WorkerBoard
from tests.service.support import UvicornProcess, copy_index

KEY = "workers-test-key"


def _worker_requests(text: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2)) for m in re.finditer(r'gare_worker_requests\{pid="(\d+)"\} ([0-9.e+]+)', text)}


def _search_total(text: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(
        r'gare_http_requests_total\{code="200",method="POST",route="/v1/search"\} ([0-9.e+]+)', text))


@pytest.fixture(scope="module")
def server(service_env, tmp_path_factory):
    sh = service_env
    root = tmp_path_factory.mktemp("workers")
    idx = copy_index(sh["index"], root / "index")
    prom = root / "prom"
    prom.mkdir()
    (prom / "counter_999999.db").write_bytes(b"stale")  # an earlier run's file: must be cleared at start
    # a worker importing torch on a loaded machine can miss uvicorn's ping for minutes: do not kill it
    env = {"GARE_API_KEYS": KEY, "PROMETHEUS_MULTIPROC_DIR": str(prom), "GARE_WORKER_HEALTHCHECK_S": "900"}
    with UvicornProcess(["--index", str(idx), "--workers", "2", "--batch-max-wait-ms", "2"], env=env,
                        ready_timeout_s=600) as srv:  # two workers import torch at once on a shared machine
        yield srv, idx, sh, prom


def _many(srv, texts, n, threads=8):
    def one(i):
        with httpx.Client(base_url=srv.base_url, timeout=60) as c:  # a new connection each: spread over workers
            return c.post("/v1/search", json={"query": texts[i % len(texts)], "k": 3})

    with cf.ThreadPoolExecutor(threads) as pool:
        return list(pool.map(one, range(n)))


def test_two_workers_ready_answer_and_metrics_sum(server):
    srv, _, sh, prom = server
    assert not (prom / "counter_999999.db").exists()
    r = httpx.get(srv.base_url + "/readyz", timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["expected_workers"] == 2
    assert len(body["workers"]) == 2 and {w["version"] for w in body["workers"]} == {"v000001"}
    pids = {str(w["pid"]) for w in body["workers"]}
    before = httpx.get(srv.base_url + "/metrics", timeout=10).text
    sent = 0
    for _ in range(5):  # connections go to whichever worker accepts first: send until both answered
        rs = _many(srv, sh["captions"], 24)
        assert all(x.status_code == 200 for x in rs)
        sent += len(rs)
        per = _worker_requests(httpx.get(srv.base_url + "/metrics", timeout=10).text)
        if set(per) == pids and all(v > 0 for v in per.values()):
            break
    text = httpx.get(srv.base_url + "/metrics", timeout=10).text
    per = _worker_requests(text)
    assert set(per) == pids and all(v > 0 for v in per.values()), per
    # the request counter is summed over both workers: it counts every search sent, whichever worker took it
    assert _search_total(text) - _search_total(before) == sent
    assert "gare_query_cache_lookups_total" in text


def test_reload_reaches_every_worker(server):
    from gare_build.build import remove

    srv, idx, sh, _ = server
    remove(str(idx), ["4"])  # writes v000002
    r = httpx.post(srv.base_url + "/v1/admin/reload", headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["version"] == "v000002" and body["workers"] == 2 and body["workers_on_version"] == 2
    ready = httpx.get(srv.base_url + "/readyz", timeout=10).json()
    assert {w["version"] for w in ready["workers"]} == {"v000002"} and len(ready["workers"]) == 2
    rs = _many(srv, sh["captions"], 32)
    assert all(x.status_code == 200 and x.json()["index_version"] == "v000002" for x in rs)
    assert all(h["id"] != 4 for x in rs for h in x.json()["results"])
    info = [line for line in httpx.get(srv.base_url + "/metrics", timeout=10).text.splitlines()
            if line.startswith("gare_index_info{") and line.endswith(" 1.0")]
    assert len(info) == 2 and all('version="v000002"' in line for line in info), info


def test_board_readiness_needs_every_worker(tmp_path):
    import os

    board = WorkerBoard(tmp_path, expected=2)
    board.publish("v1", True, 0)
    assert board.all_ready()[0] is False  # one of two
    (tmp_path / "workers" / "999999.json").write_text(json.dumps({"pid": 999999, "version": "v1", "ready": True}))
    assert board.all_ready()[0] is False  # a dead pid does not count
    (tmp_path / "workers" / f"{os.getppid()}.json").write_text(json.dumps({"pid": os.getppid(), "version": "v0", "ready": True}))
    assert board.all_ready()[0] is False  # two live, but on different versions
    (tmp_path / "workers" / f"{os.getppid()}.json").write_text(json.dumps({"pid": os.getppid(), "version": "v1", "ready": True}))
    assert board.all_ready()[0] is True
    assert board.bump_generation() == 1 and board.bump_generation() == 2 and board.generation() == 2
    board.withdraw()
    assert board.all_ready()[0] is False
