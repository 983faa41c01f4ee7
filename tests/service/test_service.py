"""The service in process (fastapi TestClient / httpx.ASGITransport with the lifespan running).

Covers: results equal the offline search, micro-batching, every error path, auth, limits, CORS, media
routes with ranges, metrics, OpenAPI, reload with requests in flight, startup refusals, settings, CLI.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from gare_search import search as S
from gare_serve.app import create_app
from gare_serve.engine.startup import StartupError, resolve_checkpoint
from gare_serve.settings import Settings, SettingsError, load_api_key_hashes, load_settings
from tests.service.support import copy_index, running_app, settings

KEY = "test-admin-key-123"


@pytest.fixture(scope="module")
def client(service_env):
    app = create_app(settings(service_env["index"], api_keys=KEY))
    with TestClient(app) as c:
        yield c


def _ids_scores(hits):
    return [h["id"] for h in hits], [h["score"] for h in hits]


# ------------------------------------------------------------------------------------------ results
@pytest.mark.parametrize("opts", [
    {"k": 5}, {"k": 4, "candidates": 8}, {"k": 6, "rerank": False}, {"k": 6, "ncl": False},
    {"k": 3, "candidates": 3, "rerank": False, "ncl": False},
])
def test_api_equals_offline_search(client, model_and_index, service_env, opts):
    model, version, _ = model_and_index
    for text in service_env["captions"][:3]:
        r = client.post("/v1/search", json={"query": text, **opts})
        assert r.status_code == 200, r.text
        body = r.json()
        want = S.search(model, version, text, S.SearchOptions(
            k=opts["k"], candidates=opts.get("candidates", max(256, opts["k"])),
            rerank=opts.get("rerank", True), ncl=opts.get("ncl", S.SearchOptions().ncl)))
        ids, scores = _ids_scores(body["results"])
        assert ids == [h.id for h in want.hits]
        np.testing.assert_allclose(scores, [h.score for h in want.hits], atol=1e-5)
        for got, h in zip(body["results"], want.hits, strict=True):
            assert got["ann_score"] == pytest.approx(h.ann_score, abs=1e-5)
            assert got["bias"] == pytest.approx(h.bias, abs=1e-7)
            assert (got["psi_score"] is None) == (h.psi_score is None)
            assert got["metadata"]["id"] == h.id and got["start"] is None and got["end"] is None
        assert [h["rank"] for h in body["results"]] == list(range(1, len(ids) + 1))
        t = body["timings_ms"]
        assert set(t) >= {"queue", "encode", "ann", "rerank", "total", "cache"} and t["total"] >= t["encode"]
        assert (t["encode"] > 0) == (t["cache"] == "miss")  # a repeated query (other options) skips the encoder
        assert body["index_version"] == version.name and body["candidates"] >= body["k"]


def test_segments_have_start_end(service_env):
    app = create_app(settings(service_env["seg_index"]))
    with TestClient(app) as c:
        body = c.post("/v1/search", json={"query": service_env["captions"][0], "k": 32}).json()
        starts = {h["start"] for h in body["results"]}
        assert starts == {0.0, 1.0}
        for h in body["results"]:
            assert h["end"] == pytest.approx(h["start"] + 1.0)
            assert h["metadata"]["start"] == h["start"]


def test_concurrent_requests_are_batched_and_equal_offline(service_env, model_and_index):
    model, version, _ = model_and_index
    texts = service_env["captions"][:12]
    app = create_app(settings(service_env["index"], batch_max_wait_ms=50, batch_max_size=8))

    async def go():
        async with running_app(app) as c:
            rs = await asyncio.gather(*(c.post("/v1/search", json={"query": t, "k": 5}) for t in texts))
            batch = await c.post("/v1/search/batch", json={"queries": texts[:5], "k": 5})
            metrics = (await c.get("/metrics")).text
            return rs, batch, metrics

    rs, batch, metrics = asyncio.run(go())
    assert all(r.status_code == 200 for r in rs)
    sizes = [r.json()["batch_size"] for r in rs]
    assert max(sizes) > 1 and max(sizes) <= 8
    for r, text in zip(rs, texts, strict=True):
        want = S.search(model, version, text, S.SearchOptions(k=5))
        ids, scores = _ids_scores(r.json()["results"])
        assert ids == [h.id for h in want.hits]
        np.testing.assert_allclose(scores, [h.score for h in want.hits], atol=1e-5)
    assert batch.status_code == 200
    bb = batch.json()
    assert [x["query"] for x in bb["results"]] == texts[:5]
    for x, r in zip(bb["results"], rs[:5], strict=True):
        assert _ids_scores(x["results"])[0] == _ids_scores(r.json()["results"])[0]
    assert "gare_batch_size_count" in metrics


# ------------------------------------------------------------------------------------------ input errors
@pytest.mark.parametrize("body, status, fragment", [
    ({"query": ""}, 422, "query"),
    ({"query": "   \t "}, 422, "blank"),
    ({"k": 5}, 422, "give exactly one of query, video_id, video_ids"),
    ({"query": "x" * 513}, 422, "at most 512"),
    ({"query": "dog", "k": 0}, 422, "k: Input should be greater than or equal to 1"),
    ({"query": "dog", "k": 1001}, 422, "k: Input should be less than or equal to 1000"),
    ({"query": "dog", "k": "5"}, 422, "k: Input should be a valid integer"),
    ({"query": "dog", "k": 2.5}, 422, "k: Input should be a valid integer"),
    ({"query": "dog", "k": 20, "candidates": 10}, 422, "candidates (10) must be >= k (20)"),
    ({"query": "dog", "candidates": 5000}, 422, "candidates: Input should be less than or equal to 2048"),
    ({"query": "dog", "rerank": "yes"}, 422, "rerank: Input should be a valid boolean"),
    ({"query": 42}, 422, "query: Input should be a valid string"),
    ({"query": "dog", "kk": 3}, 422, "kk: unknown field"),
    (["dog"], 422, "valid dictionary"),
])
def test_search_input_errors(client, body, status, fragment):
    r = client.post("/v1/search", json=body)
    assert r.status_code == status
    detail = r.json()["detail"]
    assert isinstance(detail, str) and fragment in detail, detail


@pytest.mark.parametrize("raw, fragment", [
    (b"{bad json", "malformed JSON"),
    (b"", "a JSON request body is required"),
    (b'{"query": "dog",}', "malformed JSON"),
])
def test_malformed_json(client, raw, fragment):
    r = client.post("/v1/search", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 422 and fragment in r.json()["detail"]


def test_batch_input_errors(client):
    assert client.post("/v1/search/batch", json={"queries": []}).status_code == 422
    r = client.post("/v1/search/batch", json={"queries": ["ok", " "]})
    assert r.status_code == 422 and "query 1 must not be empty or blank" in r.json()["detail"]
    r = client.post("/v1/search/batch", json={"queries": ["q"] * 65})
    assert r.status_code == 422 and "at most 64" in r.json()["detail"]


def test_body_size_limits(client):
    big = json.dumps({"query": "dog", "pad": "x" * 300_000}).encode()
    r = client.post("/v1/search", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "too large" in r.json()["detail"]

    def chunks():  # no Content-Length: counted while streaming
        for _ in range(40):
            yield b"x" * 10_000

    r = client.post("/v1/search", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_unknown_routes_and_methods(client):
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and r.json() == {"detail": "not found"}
    r = client.get("/v1/search")
    assert r.status_code == 405 and r.json() == {"detail": "method not allowed"}


def test_internal_errors_are_generic(service_env, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("failure in /very/secret/internal/path.py line 3")

    app = create_app(settings(service_env["index"]))
    with TestClient(app, raise_server_exceptions=False) as c:
        monkeypatch.setattr(S, "search_batch", boom)
        r = c.post("/v1/search", json={"query": "dog"})
        assert r.status_code == 500
        assert r.json() == {"detail": "internal server error"}
        assert "secret" not in r.text and "Traceback" not in r.text
        monkeypatch.undo()
        assert c.post("/v1/search", json={"query": "dog"}).status_code == 200  # the worker survived
        assert 'gare_http_errors_total{code="500",route="/v1/search"} 1.0' in c.get("/metrics").text


# ------------------------------------------------------------------------------------------ videos
def test_video_metadata_and_errors(client, service_env):
    r = client.get("/v1/videos/3")
    assert r.status_code == 200
    body = r.json()
    assert body["id"] == 3 and body["metadata"]["path"] == body["metadata"]["name"]
    assert "/" not in body["metadata"]["path"] and str(service_env["root"]) not in r.text  # no internal paths
    assert body["video_url"] == "/v1/videos/3/file" and body["thumbnail_url"] == "/v1/videos/3/thumbnail"
    r = client.get("/v1/videos/99999")
    assert r.status_code == 404 and "no video with id 99999" in r.json()["detail"]
    assert client.get("/v1/videos/abc").status_code == 422
    assert client.get("/v1/videos/-1").status_code == 422
    assert client.get("/v1/videos/99999/thumbnail").status_code == 404
    assert client.get("/v1/videos/99999/file").status_code == 404


def test_thumbnail_and_cache(client):
    from PIL import Image

    r = client.get("/v1/videos/2/thumbnail")
    assert r.status_code == 200 and r.headers["content-type"] == "image/jpeg"
    img = Image.open(__import__("io").BytesIO(r.content))
    assert img.format == "JPEG" and img.width > 0
    r2 = client.get("/v1/videos/2/thumbnail")
    assert r2.content == r.content
    assert client.get("/v1/videos/2/thumbnail", headers={"If-None-Match": r.headers["etag"]}).status_code == 304
    m = client.get("/metrics").text
    assert 'gare_thumbnail_cache_total{result="hit"}' in m


def test_file_ranges(client, service_env, model_and_index):
    _, version, _ = model_and_index
    path = version.path_of(5)
    data = path.read_bytes()
    r = client.get("/v1/videos/5/file")
    assert r.status_code == 200 and r.content == data
    assert r.headers["content-type"] == "video/mp4" and r.headers["accept-ranges"] == "bytes"
    r = client.get("/v1/videos/5/file", headers={"Range": "bytes=10-109"})
    assert r.status_code == 206 and r.content == data[10:110]
    assert r.headers["content-range"] == f"bytes 10-109/{len(data)}"
    r = client.get("/v1/videos/5/file", headers={"Range": "bytes=-50"})
    assert r.status_code == 206 and r.content == data[-50:]
    r = client.get("/v1/videos/5/file", headers={"Range": f"bytes={len(data) + 10}-"})
    assert r.status_code == 416 and r.headers["content-range"] == f"bytes */{len(data)}"


def test_files_gone_or_outside_library_root(service_env, tmp_path):
    from tests.service.support import build_index

    vids = tmp_path / "lib" / "clips"
    shutil.copytree(service_env["videos"], vids)
    idx = build_index(service_env["checkpoint"], vids, tmp_path / "index")
    with TestClient(create_app(settings(idx, library_root=tmp_path / "lib"))) as c:
        meta = c.get("/v1/videos/1").json()["metadata"]
        assert meta["path"] == f"clips/{meta['name']}"  # shown relative to the library root
        victim = vids / meta["name"]
        assert c.get("/v1/videos/1/file").status_code == 200
        victim.unlink()
        r = c.get("/v1/videos/1/file")
        assert r.status_code == 404 and "no longer available" in r.json()["detail"]
        assert c.get("/v1/videos/1/thumbnail").status_code == 404
        broken = vids / c.get("/v1/videos/2").json()["metadata"]["name"]
        broken.write_bytes(b"\x00not a video at all" * 100)
        r = c.get("/v1/videos/2/thumbnail")
        assert r.status_code == 422 and r.json() == {"detail": "video 2 could not be decoded for a thumbnail"}
    with TestClient(create_app(settings(idx, library_root=tmp_path / "elsewhere"))) as c:
        assert c.get("/v1/videos/2/file").status_code == 404  # outside the library root: never served


# ------------------------------------------------------------------------------------------ auth, CORS
def test_admin_needs_a_key(client, service_env):
    r = client.post("/v1/admin/reload")
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert client.post("/v1/admin/reload", headers={"Authorization": "Bearer wrong"}).status_code == 403
    assert client.post("/v1/admin/reload", headers={"X-API-Key": "wrong"}).status_code == 403
    r = client.post("/v1/admin/reload", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.json()["reloaded"] is False
    assert client.post("/v1/admin/reload", headers={"X-API-Key": KEY}).status_code == 200
    assert client.post("/v1/search", json={"query": "dog"}).status_code == 200  # search is open by default
    with TestClient(create_app(settings(service_env["index"]))) as c:  # no keys configured: admin is disabled
        r = c.post("/v1/admin/reload", headers={"X-API-Key": "anything"})
        assert r.status_code == 403 and "no API keys configured" in r.json()["detail"]


def test_keys_file_and_search_key(service_env, tmp_path):
    kf = tmp_path / "keys.txt"
    kf.write_text(f"# comment\nplain-key-1\n\nsha256:{hashlib.sha256(b'hashed-key-2').hexdigest()}\n")
    s = settings(service_env["index"], api_keys_file=kf, require_key_for_search=True)
    assert len(load_api_key_hashes(s)) == 2
    assert "plain-key-1" not in repr(s.model_dump())  # nothing in clear beyond the file itself
    with TestClient(create_app(s)) as c:
        assert c.post("/v1/search", json={"query": "dog"}).status_code == 401
        assert c.get("/v1/index").status_code == 401
        r = c.post("/v1/search", json={"query": "dog", "k": 2}, headers={"X-API-Key": "plain-key-1"})
        assert r.status_code == 200
        hit = r.json()["results"][0]
        assert "?token=" in hit["video_url"]
        assert c.get(hit["thumbnail_url"]).status_code == 200  # signed media URLs work without the header
        assert c.get(hit["video_url"], headers={"Range": "bytes=0-9"}).status_code == 206
        assert c.get(f"/v1/videos/{hit['id']}/file").status_code == 401
        other = 1 if hit["id"] != 1 else 2
        token = hit["video_url"].split("token=")[1]
        assert c.get(f"/v1/videos/{other}/file?token={token}").status_code == 401  # token is per video
        assert c.get(f"/v1/videos/{hit['id']}/file?token=1.abc").status_code == 401
        r = c.post("/v1/admin/reload", headers={"Authorization": "Bearer hashed-key-2"})
        assert r.status_code == 200
    with pytest.raises(StartupError, match="cannot read the API keys file"):
        create_app(settings(service_env["index"], api_keys_file=tmp_path / "missing.txt"))


def test_cors(client, service_env):
    r = client.get("/healthz", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    r = client.options("/v1/search", headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in r.headers
    with TestClient(create_app(settings(service_env["index"], cors_origins="https://app.example"))) as c:
        r = c.get("/healthz", headers={"Origin": "https://app.example"})
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        r = c.options("/v1/search", headers={"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                                             "Access-Control-Request-Headers": "content-type,x-api-key"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        r = c.get("/healthz", headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in r.headers


# ------------------------------------------------------------------------------------------ ops, docs, page
def test_index_health_metrics(client, service_env):
    info = client.get("/v1/index").json()
    assert info["n"] == 16 and info["index_type"] == "flat" and info["dim"] == 64 and info["max_frames"] == 6
    assert info["checkpoint"]["name"] == "tiny.safetensors" and len(info["checkpoint"]["sha256"]) == 64
    assert info["biases"]["source"] == "checkpoint-queue"
    # how the biases were computed (issue 17): fitted to the served psi score; and what ncl defaults to, and why
    assert info["biases"]["score"] == "served" and "psi score the search ranks by" in info["biases_description"]
    assert info["ncl_default"] is S.SearchOptions().ncl and info["ncl_default_reason"] == S.NCL_DEFAULT_REASON
    assert str(service_env["root"]) not in json.dumps(info)
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").json()["status"] == "ready"
    client.post("/v1/search", json={"query": "a red square"})
    client.post("/v1/search", json={"query": ""})
    m = client.get("/metrics")
    assert m.headers["content-type"].startswith("text/plain")
    text = m.text
    assert 'gare_http_requests_total{code="200",method="POST",route="/v1/search"}' in text
    assert 'gare_http_errors_total{code="422",route="/v1/search"}' in text
    for stage in ("encode", "ann", "rerank", "queue", "total"):
        assert f'gare_search_stage_seconds_count{{stage="{stage}"}}' in text
    assert 'gare_http_request_duration_seconds_bucket{le="0.05",route="/v1/search"}' in text
    assert "gare_index_entries 16.0" in text
    assert 'route="/v1/videos/{video_id}"' in text or "/v1/videos/{video_id}" not in text  # templates, not raw ids


def test_readyz_before_startup(service_env):
    with TestClient(create_app(settings(service_env["index"]))) as c:
        pass
    r = c.get("/readyz")  # lifespan finished: not ready any more
    assert r.status_code == 503


def test_openapi_document(client):
    doc = client.get("/openapi.json").json()
    paths = doc["paths"]
    for p in ("/v1/search", "/v1/search/batch", "/v1/videos/{video_id}", "/v1/videos/{video_id}/thumbnail",
              "/v1/videos/{video_id}/file", "/v1/index", "/v1/admin/reload", "/healthz", "/readyz", "/metrics"):
        assert p in paths, p
    # the API document describes fields; why a default is what it is belongs to GET /v1/index, not the schema
    assert S.NCL_DEFAULT_REASON not in json.dumps(doc) and "bench/" not in json.dumps(doc)
    schemas = doc["components"]["schemas"]
    req = schemas["SearchRequest"]
    assert req["properties"]["k"]["maximum"] == 1000 and req["properties"]["k"]["default"] == 10
    query = req["properties"]["query"]  # optional since search by example (video_id / video_ids), never null
    assert query["type"] == "string" and query["maxLength"] == 512
    assert {"required": ["query"]} in req["oneOf"]  # exactly one kind of query
    assert "video_id" in req["properties"] and "video_ids" in req["properties"]
    assert "/v1/search/image" in paths
    assert req["examples"][0]["query"]
    assert schemas["SearchResponse"]["examples"][0]["results"][0]["score"]
    assert "422" in paths["/v1/search"]["post"]["responses"]
    assert client.get("/docs").status_code == 200


def test_page_is_served(client):
    r = client.get("/")
    assert r.status_code == 200 and "<title>GARE search</title>" in r.text
    assert "default-src 'self'" in r.headers["content-security-policy"]
    assert "http" not in r.text.split("<body>")[0].replace("http-equiv", "")  # no external resources
    for f in ("app.js", "style.css"):
        assert client.get(f"/static/{f}").status_code == 200


# ------------------------------------------------------------------------------------------ reload
def test_reload_while_requests_are_in_flight(service_env, tmp_path, monkeypatch):
    import threading

    from gare_build.build import remove

    idx = copy_index(service_env["index"], tmp_path / "index")
    app = create_app(settings(idx, api_keys=KEY, batch_max_wait_ms=5, batch_max_size=4))
    texts = service_env["captions"]
    entered, gate = threading.Event(), threading.Event()
    real = S.search_batch

    def gated(*a, **k):  # the worker holds its first batch until the reload is done
        entered.set()
        assert gate.wait(30)
        return real(*a, **k)

    monkeypatch.setattr(S, "search_batch", gated)

    async def go():
        async with running_app(app) as c:
            state = app.state.gare
            old_handle = state.handle

            async def one(i):
                return await c.post("/v1/search", json={"query": texts[i % len(texts)], "k": 5})

            first = [asyncio.create_task(one(i)) for i in range(24)]
            assert await asyncio.to_thread(entered.wait, 30)
            await asyncio.sleep(0.05)  # let every request of the first wave take its version reference
            assert old_handle.refs == 24
            # a new version is written by the real indexer (gare-index remove) while those are in flight
            await asyncio.to_thread(remove, str(idx), ["3"])
            reload = await c.post("/v1/admin/reload", headers={"X-API-Key": KEY})
            still_open = not old_handle.closed and old_handle.refs == 24
            second = [asyncio.create_task(one(i)) for i in range(8)]
            gate.set()
            rs = await asyncio.gather(*first)
            later = await asyncio.gather(*second)
            after = await c.post("/v1/search", json={"query": texts[0], "k": 20})
            info = (await c.get("/v1/index")).json()
            return rs, reload, still_open, later, after, info, old_handle

    rs, reload, still_open, later, after, info, old_handle = asyncio.run(go())
    assert reload.status_code == 200, reload.text
    rj = reload.json()
    assert rj["reloaded"] is True and rj["previous"] == "v000001" and rj["version"] == "v000002" and rj["n"] == 15
    assert still_open  # retired, but kept open for the requests in flight
    assert all(r.status_code == 200 for r in rs + later)  # none lost
    assert all(r.json()["index_version"] == "v000001" for r in rs)  # in-flight requests finished on the old one
    assert all(r.json()["index_version"] == "v000002" for r in later)
    assert 3 not in [h["id"] for h in after.json()["results"]] and len(after.json()["results"]) == 15
    assert info["version"] == "v000002" and info["n"] == 15
    assert old_handle.closed and old_handle.refs == 0  # closed after its last request


def test_reload_refuses_an_index_of_another_checkpoint(service_env, tmp_path):
    from gare_index.store import open_index, write_version

    idx = copy_index(service_env["index"], tmp_path / "index")
    with TestClient(create_app(settings(idx, api_keys=KEY))) as c:
        with open_index(idx) as v:
            arrays = {k: np.array(getattr(v, k)) for k in ("ids", "norms", "units", "frames", "masks", "biases")}
            rows = v.all_metadata()
            extra = {"checkpoint": {**v.manifest["checkpoint"], "sha256": "0" * 64}}
        write_version(idx, arrays, rows, extra)
        r = c.post("/v1/admin/reload", headers={"X-API-Key": KEY})
        assert r.status_code == 409
        assert "another checkpoint" in r.json()["detail"] and "v000001" in r.json()["detail"]
        assert str(tmp_path) not in r.text
        assert c.get("/v1/index").json()["version"] == "v000001"
        assert c.post("/v1/search", json={"query": "dog"}).status_code == 200


# ------------------------------------------------------------------------------------------ startup
def test_startup_checks(service_env, tmp_path):
    from tests.service.support import make_checkpoint

    other = make_checkpoint(tmp_path / "other.safetensors", seed=5)
    with pytest.raises(StartupError) as e:
        resolve_checkpoint(settings(service_env["index"], checkpoint=other))
    msg = str(e.value)
    assert "sha256" in msg and "refusing" in msg and "gare-index build" in msg
    moved = tmp_path / "moved.safetensors"
    shutil.copy(service_env["checkpoint"], moved)
    path, sha, manifest = resolve_checkpoint(settings(service_env["index"], checkpoint=moved))
    assert path == moved and sha == manifest["checkpoint"]["sha256"]
    with pytest.raises(StartupError, match="does not exist"):
        resolve_checkpoint(settings(tmp_path / "nope"))
    with pytest.raises(StartupError, match="no index given"):
        resolve_checkpoint(Settings(index=None))
    with pytest.raises(StartupError, match="not found"):
        resolve_checkpoint(settings(service_env["index"], checkpoint=tmp_path / "gone.safetensors"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(StartupError, match="cannot read the index"):
        resolve_checkpoint(settings(tmp_path / "empty"))
    # the lifespan refuses too (nothing is served with the wrong model)
    app = create_app(settings(service_env["index"], checkpoint=other))

    async def go():
        async with running_app(app):
            pass

    with pytest.raises(StartupError, match="refusing"):
        asyncio.run(go())


# ------------------------------------------------------------------------------------------ settings, CLI
def test_settings_sources(tmp_path, monkeypatch):
    for k in list(__import__("os").environ):
        if k.startswith("GARE_"):
            monkeypatch.delenv(k)
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("index: /data/idx\nport: 9000\nmax_k: 50\ncors_origins: [https://a.example, https://b.example]\n")
    s = load_settings(cfg)
    assert str(s.index) == "/data/idx" and s.port == 9000 and s.max_k == 50
    assert s.cors_origin_list() == ["https://a.example", "https://b.example"]
    monkeypatch.setenv("GARE_PORT", "9100")
    monkeypatch.setenv("GARE_REQUIRE_KEY_FOR_SEARCH", "true")
    s = load_settings(cfg)
    assert s.port == 9100 and s.require_key_for_search is True and s.max_k == 50  # env beats the file
    s = load_settings(cfg, port=9200, index=None)
    assert s.port == 9200 and str(s.index) == "/data/idx"  # the command line beats env; None = not given
    js = tmp_path / "serve.json"
    js.write_text(json.dumps({"GARE_MAX_K": 7, "batch-max-size": 3}))
    s = load_settings(js)
    assert s.max_k == 7 and s.batch_max_size == 3
    (tmp_path / "bad.yaml").write_text("indx: /x\n")
    with pytest.raises(SettingsError, match="unknown setting 'indx'"):
        load_settings(tmp_path / "bad.yaml")
    (tmp_path / "bad2.yaml").write_text("port: [1, 2\n")
    with pytest.raises(SettingsError, match="not valid YAML"):
        load_settings(tmp_path / "bad2.yaml")
    monkeypatch.setenv("GARE_PORT", "not-a-port")
    with pytest.raises(SettingsError, match="port"):
        load_settings()
    monkeypatch.setenv("GARE_PORT", "8000")
    with pytest.raises(SettingsError, match="default_candidates"):
        load_settings(default_candidates=100, max_candidates=50)


def test_cli(service_env, tmp_path, capsys, monkeypatch):
    from gare_serve.cli import main
    from tests.service.support import make_checkpoint

    assert main(["--index", str(service_env["index"]), "--check"]) == 0
    assert "ok: index" in capsys.readouterr().out
    other = make_checkpoint(tmp_path / "other.safetensors", seed=7)
    assert main(["--index", str(service_env["index"]), "--checkpoint", str(other), "--check"]) == 2
    err = capsys.readouterr().err
    assert "refusing" in err and "Traceback" not in err
    assert main(["--index", str(tmp_path / "missing"), "--check"]) == 2
    assert main(["--config", str(tmp_path / "nope.yaml"), "--check"]) == 2
    assert "cannot read config file" in capsys.readouterr().err
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO("my-key\n"))
    assert main(["--hash-key"]) == 0
    assert capsys.readouterr().out.strip() == "sha256:" + hashlib.sha256(b"my-key").hexdigest()


def test_httpx_asgi_transport_smoke(service_env):
    """The plain httpx.ASGITransport route (no TestClient) works with the lifespan helper."""
    app = create_app(settings(service_env["index"]))

    async def go():
        async with running_app(app) as c:
            return await c.post("/v1/search", json={"query": service_env["captions"][0], "k": 3})

    r = asyncio.run(go())
    assert r.status_code == 200 and len(r.json()["results"]) == 3
    assert isinstance(r, httpx.Response)
