"""`gare-serve --workers 2 --engine shared`: two real HTTP workers and one engine process (device cpu), over HTTP.

Checked: the answers equal the in-process service's; one engine batch holds queries of both workers (the engine's
counter of mixed batches, not timing); the workers map none of the index's vectors or ANN (the engine does); auth
and limits answer in the workers; a reload moves both workers; a killed engine gives 503 with a clear message, and
the supervisor's restarted engine answers again.
"""

from __future__ import annotations

import concurrent.futures as cf
import io
import os
import re
import signal
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.service.support import UvicornProcess, answers_in_a_fresh_process, copy_index, settings

KEY = "engine-workers-key"
HANG_S = 600  # hang guards: an engine start (torch import, model, kernel compile) on a busy 2-core machine
ENGINE_TIMEOUT_S = 10  # a call (and the supervisor's hello) unanswered this long: the engine is not answering
INDEX_FILES = ("units.npy", "frames.npy", "ann.faiss")  # what stage 1 and the rerank read: the engine's alone


def _png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (48, 32), (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


def _hits(body: dict) -> list[tuple]:
    return [(h["id"], h["score"], h["ann_score"], h["psi_score"], h["bias"]) for h in body["results"]]


def _metric(text: str, name: str, labels: str = "") -> float:
    pat = re.escape(name) + (re.escape("{" + labels + "}") if labels else "") + r" ([0-9.e+-]+)"
    return sum(float(m.group(1)) for m in re.finditer(r"^" + pat + "$", text, re.M))


def _mapped(pid: int) -> set[str]:
    return {Path(line.split()[-1]).name for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
            if len(line.split()) >= 6}


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


@pytest.fixture(scope="module")
def server(service_env, tmp_path_factory):
    root = tmp_path_factory.mktemp("engine-workers")
    idx = copy_index(service_env["index"], root / "index")
    prom = root / "prom"
    prom.mkdir()
    env = {"GARE_API_KEYS": KEY, "PROMETHEUS_MULTIPROC_DIR": str(prom), "GARE_WORKER_HEALTHCHECK_S": "900",
           "GARE_RECALL_SAMPLE_RATE": "0", "GARE_INDEX_POLL_S": "0", "GARE_RELOAD_WAIT_S": "60",
           "GARE_ENGINE_TIMEOUT_S": str(ENGINE_TIMEOUT_S)}
    args = ["--index", str(idx), "--workers", "2", "--engine", "shared", "--device", "cpu", "--text-encoder", "fp32",
            "--result-cache-entries", "0", "--batch-max-wait-ms", "50"]
    with UvicornProcess(args, env=env, ready_timeout_s=HANG_S) as srv:
        yield srv, idx, service_env


@pytest.fixture(scope="module")
def reference(server):
    """The in-process service's answers on the same (first) index version."""
    srv, idx, sh = server
    # at the server's thread count (UvicornProcess sets GARE_TORCH_THREADS): a float tower's bits hold per
    # thread count (gare.text_fixed), and on some CPUs (AVX-512 EPYC) a short caption's embedding differs in its
    # last bits between 1 and 2 threads; in a fresh process (support.answers_in_a_fresh_process says why)
    s = settings(idx, device="cpu", index_poll_s=0, recall_sample_rate=0,
                 torch_threads=int(srv.env["GARE_TORCH_THREADS"]))
    calls = [("/v1/search", {"json": {"query": q, "k": 5}}) for q in sh["captions"]]
    calls += [("/v1/search", {"json": {"video_ids": [2, 3], "k": 4}}),
              ("/v1/search/image", {"files": {"image": ("a.png", _png(), "image/png")}, "data": {"k": "5"}})]
    out = answers_in_a_fresh_process(s, calls, HANG_S)
    return out[:-2], out[-2], out[-1]


def _ready(srv) -> dict:
    r = httpx.get(srv.base_url + "/readyz", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_one_engine_holds_the_index_the_workers_do_not(server):
    srv, _, _ = server
    body = _ready(srv)
    workers = [w["pid"] for w in body["workers"]]
    engine = body["engine"]
    assert len(workers) == 2 and engine["up"] and engine["device"] == "cpu"
    assert engine["pid"] not in workers and engine["pid"] != srv.proc.pid
    for pid in workers:  # a worker maps no stage-1 vectors, frames or ANN; the engine maps them
        assert not (_mapped(pid) & set(INDEX_FILES)), (pid, _mapped(pid) & set(INDEX_FILES))
    assert set(INDEX_FILES) <= _mapped(engine["pid"])


def test_answers_equal_the_in_process_service(server, reference):
    srv, _, sh = server
    texts, example, image = reference
    with httpx.Client(base_url=srv.base_url, timeout=60) as c:
        for q, want in zip(sh["captions"], texts, strict=True):  # one at a time: batches of one, bitwise
            got = c.post("/v1/search", json={"query": q, "k": 5}).json()
            assert _hits(got) == _hits(want) and got["index_version"] == want["index_version"] == "v000001"
        assert _hits(c.post("/v1/search", json={"video_ids": [2, 3], "k": 4}).json()) == _hits(example)
        got = c.post("/v1/search/image", files={"image": ("a.png", _png(), "image/png")}, data={"k": "5"}).json()
        assert _hits(got) == _hits(image)


def test_one_engine_batch_holds_queries_of_both_workers(server, reference):
    srv, _, sh = server
    texts, _, _ = reference
    want = {q: r for q, r in zip(sh["captions"], texts, strict=True)}
    pairs = [sh["captions"][i: i + 2] for i in range(0, len(sh["captions"]) - 1, 2)]

    def one(i):
        with httpx.Client(base_url=srv.base_url, timeout=120) as c:  # a new connection each: spread over workers
            return c.post("/v1/search/batch", json={"queries": pairs[i % len(pairs)], "k": 5})

    mixed = 0.0
    for _ in range(40):  # a hang guard: each round sends 8 concurrent requests, a mixed batch is near certain
        with cf.ThreadPoolExecutor(8) as pool:
            rs = list(pool.map(one, range(8)))
        for r in rs:
            assert r.status_code == 200, r.text
            for a in r.json()["results"]:  # whatever batch they shared: the in-process answer, to float32 rounding
                ref = want[a["query"]]
                assert [h["id"] for h in a["results"]] == [h["id"] for h in ref["results"]]
                np.testing.assert_allclose([h["score"] for h in a["results"]],
                                           [h["score"] for h in ref["results"]], atol=1e-5)
        metrics = httpx.get(srv.base_url + "/metrics", timeout=30).text
        mixed = _metric(metrics, "gare_engine_mixed_batches_total")
        if mixed > 0:
            break
    assert mixed > 0, "no engine batch held queries of both workers"
    assert _metric(metrics, "gare_engine_batch_workers_bucket", 'le="1.0"') < _metric(
        metrics, "gare_engine_batch_workers_count")
    assert _metric(metrics, "gare_engine_queue_seconds_count") > 0
    assert _metric(metrics, "gare_engine_roundtrip_seconds_count", 'op="texts"') > 0


def test_auth_and_limits_answer_in_the_workers(server):
    srv, _, sh = server
    assert httpx.post(srv.base_url + "/v1/search", json={"query": sh["captions"][0], "k": 3}, timeout=60).status_code == 200
    before = _metric(httpx.get(srv.base_url + "/metrics", timeout=30).text, "gare_engine_requests_total", 'op="texts"')
    with httpx.Client(base_url=srv.base_url, timeout=60) as c:
        assert c.post("/v1/admin/reload").status_code == 401
        assert c.post("/v1/search", json={"query": "x" * 300_000, "k": 3}).status_code == 413
        assert c.post("/v1/search", json={"query": "a red ball", "k": 0}).status_code == 422
    after = _metric(httpx.get(srv.base_url + "/metrics", timeout=30).text, "gare_engine_requests_total", 'op="texts"')
    assert after == before > 0


def test_reload_reaches_the_engine_and_both_workers(server):
    from gare_build.build import remove

    srv, idx, sh = server
    remove(str(idx), ["4"])  # writes v000002
    r = httpx.post(srv.base_url + "/v1/admin/reload", headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["version"] == "v000002" and body["workers"] == 2 and body["workers_on_version"] == 2
    ready = _ready(srv)
    assert {w["version"] for w in ready["workers"]} == {"v000002"} and ready["engine"]["version"] == "v000002"

    def one(i):
        with httpx.Client(base_url=srv.base_url, timeout=60) as c:
            return c.post("/v1/search", json={"query": sh["captions"][i % len(sh["captions"])], "k": 15})

    with cf.ThreadPoolExecutor(8) as pool:
        rs = list(pool.map(one, range(24)))
    assert all(x.status_code == 200 and x.json()["index_version"] == "v000002" for x in rs)
    assert all(h["id"] != 4 for x in rs for h in x.json()["results"])


def _restarted(srv, old: int) -> dict:
    """/readyz once a new engine (not ``old``) answers; hang guard HANG_S."""
    deadline = time.monotonic() + HANG_S
    while True:
        rr = httpx.get(srv.base_url + "/readyz", timeout=30)
        body = rr.json()
        if rr.status_code == 200 and body["engine"]["pid"] != old:
            return body
        assert "engine" in body and time.monotonic() < deadline, rr.text
        time.sleep(0.5)


def test_a_hung_engine_gives_503_then_the_supervisor_replaces_it(server):
    """SIGSTOP: alive, not answering. The workers answer 503 once a call waited engine_timeout_s; the supervisor's
    hello gets no answer either, so it kills the engine and starts another."""
    srv, _, sh = server
    q = {"query": sh["captions"][1], "k": 5}
    before = httpx.post(srv.base_url + "/v1/search", json=q, timeout=60)
    old = _ready(srv)["engine"]["pid"]
    os.kill(old, signal.SIGSTOP)
    try:
        r = httpx.post(srv.base_url + "/v1/search", json=q, timeout=10 * ENGINE_TIMEOUT_S)
        # "did not answer" when the call's wait ran out first, "stopped answering" when the supervisor killed it first
        assert r.status_code == 503 and "search engine" in r.json()["detail"], r.text
        _restarted(srv, old)
    finally:
        if _alive(old):  # the supervisor did not kill it: let it go on, so the module can end
            os.kill(old, signal.SIGCONT)
    assert not _alive(old)
    again = httpx.post(srv.base_url + "/v1/search", json=q, timeout=60)
    assert again.status_code == 200 and _hits(again.json()) == _hits(before.json())
    assert "did not answer within" in srv.output()


def test_a_killed_engine_gives_503_then_the_supervisor_restarts_it(server):
    """Each restart costs one engine start (counted across the module's restarts)."""
    srv, _, sh = server
    q = {"query": sh["captions"][0], "k": 5}
    before = httpx.post(srv.base_url + "/v1/search", json=q, timeout=60)
    starts = _metric(httpx.get(srv.base_url + "/metrics", timeout=30).text, "gare_engine_starts_total")
    old = _ready(srv)["engine"]["pid"]
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + HANG_S
    while _alive(old):  # SIGKILL lands asynchronously: ask once it is dead (or a zombie of the supervisor)
        assert time.monotonic() < deadline, "the killed engine never died"
        time.sleep(0.05)
    r = httpx.post(srv.base_url + "/v1/search", json=q, timeout=60)
    assert r.status_code == 503 and "search engine" in r.json()["detail"], r.text
    _restarted(srv, old)
    again = httpx.post(srv.base_url + "/v1/search", json=q, timeout=60)
    assert again.status_code == 200 and _hits(again.json()) == _hits(before.json())
    assert _metric(httpx.get(srv.base_url + "/metrics", timeout=30).text, "gare_engine_starts_total") == starts + 1


def test_stopping_the_supervisor_stops_the_engine_after_the_workers(server):
    srv, _, _ = server
    ready = _ready(srv)
    pids = [ready["engine"]["pid"], *(w["pid"] for w in ready["workers"])]
    assert srv.stop() == 0, srv.output()[-3000:]
    assert not any(_alive(p) for p in pids)
    out = srv.output()
    assert "stopped the search engine" in out and out.rindex("stopped the search engine") > out.rindex(
        "Waiting for child process")  # the engine stops last, after the workers have drained
