"""`filter` in POST /v1/search and /v1/search/batch: it restricts the results (equal to the offline filtered search),
keys the result cache, shows its plan in timings_ms and the metrics; a bad filter is a 422 naming the problem."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from PIL import Image

from gare_search import by_example as E
from gare_search import search as S
from gare_serve.app import create_app
from tests.service.support import copy_index, settings

ALLOWED = [1, 3, 5, 7, 11]


@pytest.fixture(scope="module")
def client(service_env, tmp_path_factory):
    idx = copy_index(service_env["index"], tmp_path_factory.mktemp("filter") / "index")
    with TestClient(create_app(settings(idx, result_cache_entries=64)), raise_server_exceptions=False) as c:
        yield c


def test_a_filter_restricts_the_results_as_offline(client, model_and_index):
    model, version, env = model_and_index
    spec = {"id": {"$in": ALLOWED}}
    for q in env["captions"][:3]:
        r = client.post("/v1/search", json={"query": q, "k": 4, "candidates": 8, "filter": spec})
        assert r.status_code == 200, r.text
        body = r.json()
        got = [h["id"] for h in body["results"]]
        assert set(got) <= set(ALLOWED) and len(got) == 4
        want = S.search(model, version, q, S.SearchOptions(k=4, candidates=8, filter=version.compile_filter(spec),
                                                           ncl=body["ncl"]))
        assert got == [h.id for h in want.hits]
        assert [h["score"] for h in body["results"]] == pytest.approx([h.score for h in want.hits], abs=1e-4)
        assert body["timings_ms"]["plan"] == "exact" and body["timings_ms"]["filter"] >= 0
    # no filter: no plan, and results from the whole gallery
    r = client.post("/v1/search", json={"query": env["captions"][0], "k": 16, "candidates": 16}).json()
    assert r["timings_ms"]["plan"] is None and len(r["results"]) == 16


def test_the_result_cache_keys_on_the_filter(client, model_and_index):
    _, _, env = model_and_index
    q = env["captions"][5]
    a = client.post("/v1/search", json={"query": q, "k": 3, "filter": {"id": {"$lt": 8}}}).json()
    b = client.post("/v1/search", json={"query": q, "k": 3, "filter": {"id": {"$gte": 8}}}).json()
    assert all(h["id"] < 8 for h in a["results"]) and all(h["id"] >= 8 for h in b["results"])
    again = client.post("/v1/search", json={"query": q, "k": 3, "filter": {"id": {"$lt": 8}}}).json()
    assert again["timings_ms"]["cache"] == "result" and again["results"] == a["results"]
    assert again["timings_ms"]["plan"] == "cached"


def test_batch_takes_a_filter(client, model_and_index):
    _, version, env = model_and_index
    folder = str(version.metadata([0])[0]["path"]).rsplit("/", 1)[0]
    r = client.post("/v1/search/batch", json={"queries": env["captions"][:3], "k": 3,
                                              "filter": {"$and": [{"folder": {"$prefix": folder}},
                                                                  {"$not": {"id": {"$in": [0, 1, 2, 3]}}}]}})
    assert r.status_code == 200, r.text
    for res in r.json()["results"]:
        assert len(res["results"]) == 3 and all(h["id"] > 3 for h in res["results"])


@pytest.mark.parametrize("spec, words", [
    ({"chanel": "news"}, ["unknown field 'chanel'", "filter.chanel"]),
    ({"duration": {"$gt": "long"}}, ["filter.duration.$gt", "number"]),
    ({"path": {"$gte": "a"}}, ["$gte does not apply to field 'path'"]),
    ({"id": {"$in": 3}}, ["$in takes a list"]),
    ({"$or": []}, ["filter.$or", "non-empty list"]),
])
def test_a_bad_filter_is_a_422_naming_the_problem(client, spec, words):
    for path, body in (("/v1/search", {"query": "a dog"}), ("/v1/search/batch", {"queries": ["a dog"]})):
        r = client.post(path, json={**body, "filter": spec})
        assert r.status_code == 422, r.text
        for w in words:
            assert w in r.json()["detail"], (w, r.json())


def test_too_deep_too_long_and_not_an_object_are_422(client):
    deep: dict = {"id": 1}
    for _ in range(10):
        deep = {"$not": deep}
    for spec, word in ((deep, "too deep"), ({"id": {"$in": list(range(5000))}}, "too long"), (["id"], "")):
        r = client.post("/v1/search", json={"query": "a dog", "filter": spec})
        assert r.status_code == 422 and word in str(r.json()["detail"]), r.text


def test_by_example_and_by_image_take_a_filter(client, model_and_index):
    _, version, _ = model_and_index
    spec = {"id": {"$in": ALLOWED}}
    r = client.post("/v1/search", json={"video_id": 1, "k": 3, "filter": spec})
    assert r.status_code == 200, r.text
    body = r.json()
    want = E.search_by_videos(version, [1], S.SearchOptions(k=3, candidates=body["candidates"],
                                                            filter=version.compile_filter(spec)))
    assert [h["id"] for h in body["results"]] == [h.id for h in want.hits]
    assert set(h["id"] for h in body["results"]) <= set(ALLOWED) - {1} and body["timings_ms"]["plan"] == "exact"
    png = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (48, 64, 3), dtype=np.uint8)).save(png, "PNG")
    files = {"image": ("x.png", png.getvalue(), "image/png")}
    r = client.post("/v1/search/image", files=files, data={"k": "3", "filter": json.dumps(spec)})
    assert r.status_code == 200, r.text
    assert {h["id"] for h in r.json()["results"]} <= set(ALLOWED) and len(r.json()["results"]) == 3
    for bad, word in (("{not json", "not valid JSON"), ('{"chanel": 1}', "unknown field 'chanel'")):
        r = client.post("/v1/search/image", files=files, data={"k": "3", "filter": bad})
        assert r.status_code == 422 and word in r.json()["detail"], r.text
    r = client.post("/v1/search", json={"video_ids": [1, 2], "filter": {"id": {"$gt": "x"}}})
    assert r.status_code == 422 and "filter.id.$gt" in r.json()["detail"]


def test_openapi_documents_the_filter_and_metrics_count_plans(client):
    spec = client.get("/openapi.json").json()
    schemas = spec["components"]["schemas"]
    req = next(v for k, v in schemas.items() if k.startswith("SearchRequest"))
    f = req["properties"]["filter"]
    assert "$gte" in f["description"] and f["examples"][0]["channel"] == "news"
    client.post("/v1/search", json={"query": "x", "filter": {"id": 2}})
    assert 'gare_filter_plans_total{plan="exact"}' in client.get("/metrics").text


_KEYS = st.sampled_from(["id", "duration", "folder", "path", "mtime", "nope", "$and", "$or", "$not", "$in", "$gt",
                         "$prefix", "$eq", "$nin", "$regex", ""])
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-10**20, 10**20) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_KEYS, inner, max_size=4),
    max_leaves=20,
)


@hsettings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=st.dictionaries(_KEYS, _JSON, max_size=4))
def test_random_filters_never_give_a_5xx(client, spec):
    r = client.post("/v1/search", json={"query": "a dog", "k": 3, "candidates": 4, "filter": spec})
    assert r.status_code in (200, 422), (spec, r.status_code, r.text)
    if r.status_code == 422:
        assert r.json()["detail"]
