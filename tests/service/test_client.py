"""The typed Python client (gare_serve.client) against the real app in process (FastAPI's TestClient runs the
lifespan): every search kind returns what the raw HTTP answer holds, and every error class is raised for the
answer that means it, with the server's message."""

from __future__ import annotations

import io

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from gare_serve.app import create_app
from gare_serve.client import (
    BadRequest,
    BatchResult,
    Forbidden,
    GareClient,
    Hit,
    NotFound,
    SearchResult,
    Unauthorized,
)
from tests.service.support import settings

SEARCH_KEY = "client-search-key-1"
ADMIN_KEY = "client-admin-key-2"


@pytest.fixture(scope="module")
def http(service_env):
    app = create_app(settings(service_env["index"], search_keys=SEARCH_KEY, admin_keys=ADMIN_KEY,
                              require_key_for_search=True))
    with TestClient(app) as tc:
        yield tc


def _raw(http, path, key=SEARCH_KEY, **kw):
    r = http.post(path, headers={"Authorization": f"Bearer {key}"}, **kw)
    assert r.status_code == 200, r.text
    return r.json()


def _png() -> bytes:
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 80, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def test_text_search_is_the_raw_answer_typed(http, service_env):
    q = service_env["captions"][3]
    gare = GareClient(http=http, api_key=SEARCH_KEY)
    got = gare.search(q, k=5, candidates=12)
    raw = _raw(http, "/v1/search", json={"query": q, "k": 5, "candidates": 12})
    assert isinstance(got, SearchResult) and all(isinstance(h, Hit) for h in got.results)
    assert got.ids == [h["id"] for h in raw["results"]] and len(got.ids) == 5
    assert [h.score for h in got.results] == [h["score"] for h in raw["results"]]
    assert got.query == q and got.k == 5 and got.candidates == 12 and got.index_version == raw["index_version"]
    assert got.timings_ms.total > 0 and got.results[0].metadata == raw["results"][0]["metadata"]


def test_batch_keeps_the_queries_order_and_equals_single_searches(http, service_env):
    qs = service_env["captions"][:3]
    gare = GareClient(http=http, api_key=SEARCH_KEY)
    got = gare.search_batch(qs, k=4)
    assert isinstance(got, BatchResult) and [r.query for r in got.results] == qs
    assert [r.ids for r in got.results] == [gare.search(q, k=4).ids for q in qs]
    with pytest.raises(TypeError, match="one string"):
        gare.search_batch("a single string", k=4)


def test_search_like_and_by_image_are_the_raw_answers(http):
    gare = GareClient(http=http, api_key=SEARCH_KEY)
    like = gare.search_like([1, 2], k=3)
    assert like.ids == [h["id"] for h in _raw(http, "/v1/search", json={"video_ids": [1, 2], "k": 3})["results"]]
    assert like.example == {"kind": "videos", "ids": [1, 2]}
    png = _png()
    img = gare.search_image(png, k=3, content_type="image/png")
    raw = _raw(http, "/v1/search/image", data={"k": "3"}, files={"image": ("x.png", png, "image/png")})
    assert img.ids == [h["id"] for h in raw["results"]] and img.example["kind"] == "image"
    with pytest.raises(ValueError, match="content_type"):
        gare.search_image(png)


def test_an_image_file_path_takes_its_type_from_its_name(http, tmp_path):
    p = tmp_path / "frame.png"
    p.write_bytes(_png())
    gare = GareClient(http=http, api_key=SEARCH_KEY)
    assert gare.search_image(p, k=2).ids == gare.search_image(p.read_bytes(), k=2, content_type="image/png").ids


def test_each_error_class_carries_the_servers_message(http):
    with pytest.raises(Unauthorized) as e:
        GareClient(http=http).search("a dog", k=3)  # no key, and search needs one here
    assert e.value.status == 401 and "API key" in str(e.value.detail)
    searcher = GareClient(http=http, api_key=SEARCH_KEY)
    with pytest.raises(BadRequest) as e:
        searcher.search("a dog", k=0)
    assert e.value.status == 422 and "k" in str(e.value)  # the validation error names the field
    with pytest.raises(NotFound) as e:
        searcher.video(10**9)
    assert e.value.status == 404
    with pytest.raises(Forbidden) as e:
        searcher.reload()  # a search key on an admin route
    assert e.value.status == 403


def test_the_admin_key_reloads_and_the_read_routes_answer(http, service_env):
    admin = GareClient(http=http, api_key=ADMIN_KEY)
    r = admin.reload()
    assert r["reloaded"] is False and r["version"] == admin.index()["version"]
    v = admin.video(0)
    assert v["id"] == 0 and "metadata" in v
    assert admin.ready()


def test_a_client_needs_somewhere_to_send():
    with pytest.raises(ValueError, match="base_url"):
        GareClient()


def test_a_filter_travels_and_a_bad_one_is_a_bad_request(http, service_env):
    gare = GareClient(http=http, api_key=SEARCH_KEY)
    got = gare.search(service_env["captions"][0], k=5, filter={"id": {"$in": [1, 2, 3]}})
    assert got.ids and set(got.ids) <= {1, 2, 3}
    assert gare.search_batch(service_env["captions"][:2], k=5, filter={"id": {"$in": [4]}}).results[1].ids == [4]
    with pytest.raises(BadRequest) as e:
        gare.search("a dog", k=3, filter={"chanel": "news"})
    assert e.value.status == 422 and "chanel" in str(e.value)
