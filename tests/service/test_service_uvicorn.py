"""`gare-serve` as a real uvicorn process on 127.0.0.1 (random free port), driven over HTTP."""

from __future__ import annotations

import concurrent.futures as cf
import subprocess
import sys

import httpx
import pytest

from tests.service.support import REPO, UvicornProcess, copy_index, free_port, make_checkpoint

KEY = "uvicorn-test-key"


@pytest.fixture(scope="module")
def server(service_env, tmp_path_factory):
    sh = service_env
    idx = copy_index(sh["index"], tmp_path_factory.mktemp("uv") / "index")
    with UvicornProcess(["--index", str(idx), "--batch-max-wait-ms", "5"], env={"GARE_API_KEYS": KEY}) as srv:
        yield srv, idx, sh


def test_search_over_http(server):
    srv, _, sh = server
    with httpx.Client(base_url=srv.base_url, timeout=30) as c:
        r = c.post("/v1/search", json={"query": sh["captions"][0], "k": 4})
        assert r.status_code == 200, r.text
        body = r.json()
        assert len(body["results"]) == 4 and body["index_version"] == "v000001"
        assert "server" not in r.headers  # no server banner
        r = c.post("/v1/search/batch", json={"queries": sh["captions"][:3], "k": 2})
        assert r.status_code == 200 and len(r.json()["results"]) == 3
        hit = body["results"][0]
        full = c.get(hit["video_url"])
        assert full.status_code == 200 and len(full.content) == hit["metadata"]["size"]
        part = c.get(hit["video_url"], headers={"Range": "bytes=100-199"})
        assert part.status_code == 206 and part.content == full.content[100:200]
        assert c.get(hit["video_url"], headers={"Range": "bytes=99999999-"}).status_code == 416
        assert c.get(hit["thumbnail_url"]).headers["content-type"] == "image/jpeg"
        assert c.post("/v1/search", json={"query": " "}).status_code == 422
        assert c.post("/v1/search", content=b"x" * 300_000, headers={"content-type": "application/json"}).status_code == 413
        assert 'route="/v1/search"' in c.get("/metrics").text


def test_concurrent_clients_and_reload(server):
    from gare_build.build import remove

    srv, idx, sh = server
    texts = sh["captions"]

    def one(i):
        with httpx.Client(base_url=srv.base_url, timeout=60) as c:
            return c.post("/v1/search", json={"query": texts[i % len(texts)], "k": 3})

    with cf.ThreadPoolExecutor(16) as pool:
        futs = [pool.submit(one, i) for i in range(48)]
        remove(str(idx), ["4"])  # gare-index remove writes v000002 while requests are running
        r = httpx.post(srv.base_url + "/v1/admin/reload", headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        more = [pool.submit(one, i) for i in range(16)]
        rs = [f.result() for f in futs + more]
    assert r.status_code == 200 and r.json()["version"] == "v000002"
    assert all(x.status_code == 200 for x in rs)
    assert {x.json()["index_version"] for x in rs} <= {"v000001", "v000002"}
    assert all(x.json()["index_version"] == "v000002" for x in rs[48:])
    assert max(x.json()["batch_size"] for x in rs) > 1  # concurrent clients shared micro-batches


def test_refuses_to_start_with_another_checkpoint(service_env, tmp_path):
    sh = service_env
    other = make_checkpoint(tmp_path / "other.safetensors", seed=3)
    proc = subprocess.run(
        [sys.executable, "-m", "gare_serve.cli", "--index", str(sh["index"]), "--checkpoint", str(other),
         "--port", str(free_port())],
        cwd=REPO, capture_output=True, text=True, timeout=120, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 2
    assert "refusing to serve scores from another model" in proc.stderr
    assert "Traceback" not in proc.stderr
