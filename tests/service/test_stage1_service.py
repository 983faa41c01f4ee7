"""The index's stage-1 figures in the service (issue 13): GET /v1/index shows them, a search without
`candidates` uses the index's chosen K, the page footer has the slot the page fills from /v1/index."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from gare_index.store import open_index
from gare_serve.app import create_app
from tests.indexer.support import reseal
from tests.service.support import copy_index, settings


@pytest.fixture(scope="module")
def client(service_env):
    with TestClient(create_app(settings(service_env["index"]))) as c:
        yield c


def test_index_info_shows_stage1(client, service_env):
    m = open_index(service_env["index"]).manifest
    st = m["stage1"]
    info = client.get("/v1/index").json()
    assert info["default_candidates"] == st["default_candidates"] == 16  # 16 videos: K=16 holds every psi top-10
    got = info["stage1"]
    assert "trials" not in got
    for key in ("recall", "recall_target", "recall_at", "coverage", "default_candidates", "query_source", "params",
                "p50_ms", "index_type", "latency_budget_ms"):
        assert got[key] == st[key], key
    nq = m["biases"]["n_queries"]  # the checkpoint's queue: the sample queries
    # the sample: the checkpoint's queue mixed with queries spread over the gallery (gare_build.tuning.queries)
    assert got["query_source"].startswith(f"ncl-queue ({nq} queries) + spread-gallery (")
    assert got["recall"] >= got["recall_target"] == 0.995


def test_search_defaults_to_the_index_K(client):
    r = client.post("/v1/search", json={"query": "a red square"}).json()
    assert r["candidates"] == 16
    r = client.post("/v1/search", json={"query": "a red square", "k": 20}).json()
    assert r["candidates"] == 20  # K >= k
    r = client.post("/v1/search", json={"query": "a red square", "candidates": 300}).json()
    assert r["candidates"] == 300
    assert client.post("/v1/search", json={"query": "a", "k": 5, "candidates": 4}).status_code == 422
    r = client.post("/v1/search/batch", json={"queries": ["a red square", "blue"]}).json()
    assert [x["candidates"] for x in r["results"]] == [16, 16]


def test_index_without_stage1_uses_the_setting(service_env, tmp_path):
    idx = copy_index(service_env["index"], tmp_path / "idx")
    v = open_index(idx)
    mpath = v.path / "manifest.json"
    v.close()
    m = json.loads(mpath.read_text())
    m["stage1"] = None  # an index built before issue 13 (or with --no-tune)
    mpath.unlink()  # a copy may share the file with the original through a hard link
    mpath.write_text(json.dumps(m))
    reseal(mpath.parent)
    with TestClient(create_app(settings(idx, default_candidates=40))) as c:
        info = c.get("/v1/index").json()
        assert info["stage1"] is None and info["default_candidates"] == 40
        assert c.post("/v1/search", json={"query": "a red square"}).json()["candidates"] == 40


def test_page_footer_has_the_stage1_slot(client):
    page = client.get("/").text
    assert '<span id="stage1-info"></span>' in page.split("<footer")[1]
    js = client.get("/static/app.js").text
    assert "stage1Text(info)" in js and "default_candidates" in js
