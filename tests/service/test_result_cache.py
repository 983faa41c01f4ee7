"""The search result cache (gare_serve/engine/result_cache.py): a repeat on the same version runs no stage and returns
exactly the first answer; anything that could change the answer (options, version, text) misses."""

from __future__ import annotations

import numpy as np
from fastapi.testclient import TestClient

from gare_search import search as S
from gare_serve.app import create_app
from gare_serve.engine.result_cache import ResultCache
from tests.service.support import settings
from tests.service.test_serve_scale import CountingEncoder


def _result(ids):
    return S.QueryResult([S.Hit(id=i, score=0.5, ann_score=0.4, psi_score=0.5, bias=0.0) for i in ids], {"total": 1.0})


def test_lru_bound_copies_and_counts():
    rc = ResultCache(2, normalize=lambda t: " ".join(t.lower().split()))
    opts = S.SearchOptions(k=3)
    k1, k2, k3 = (rc.key("v1", "sha", "fp32", t, opts) for t in ("A  dog", "a cat", "a cow"))
    assert k1 == rc.key("v1", "sha", "fp32", " a dog ", opts)  # normalised text
    assert k1 != rc.key("v2", "sha", "fp32", "a dog", opts)  # another version
    assert k1 != rc.key("v1", "sha", "fp32", "a dog", S.SearchOptions(k=4))  # other options
    assert k1 != rc.key("v1", "sha", "int8", "a dog", opts)  # another text tower
    assert rc.get(k1) is None
    rc.put(k1, _result([1, 2]))
    got = rc.get(k1)
    assert got.cached and got.timings == {} and [h.id for h in got.hits] == [1, 2]
    got.hits[0].id = 99  # the caller's copy: the cache keeps its own
    assert [h.id for h in rc.get(k1).hits] == [1, 2]
    rc.put(k2, _result([3]))
    rc.get(k1)  # k1 becomes the most recent: k2 is evicted next
    rc.put(k3, _result([4]))
    assert len(rc) == 2 and rc.get(k2) is None and rc.get(k1) is not None and rc.get(k3) is not None
    st = rc.stats()
    assert (st["entries"], st["hits"], st["misses"]) == (2, 5, 2)
    assert st["bytes"] == sum(ResultCache.entry_bytes(k, rc.get(k)) for k in (k1, k3))
    rc.clear()
    assert len(rc) == 0 and rc.get(k1) is None
    off = ResultCache(0)
    off.put(k1, _result([1]))
    assert not off.enabled and off.get(k1) is None and len(off) == 0


def test_byte_bound_evicts_and_refuses_oversized_entries():
    opts = S.SearchOptions(k=50, candidates=64)
    one = ResultCache.entry_bytes(("v", "s", "e", "q0", opts), _result(range(50)))
    rc = ResultCache(1000, max_bytes=2 * one + one // 2)  # room for two 50-hit results, not three
    keys = [rc.key("v", "s", "e", f"q{i}", opts) for i in range(3)]
    for k in keys:
        rc.put(k, _result(range(50)))
    assert len(rc) == 2 and rc.get(keys[0]) is None and rc.stats()["bytes"] <= rc.max_bytes
    rc.put(keys[0], _result(range(50)))  # replacing/adding keeps the bound
    assert len(rc) == 2 and rc.stats()["bytes"] <= rc.max_bytes
    tiny = ResultCache(10, max_bytes=one // 2)
    tiny.put(keys[0], _result(range(50)))  # larger than the whole cache: not stored
    assert len(tiny) == 0 and tiny.get(keys[0]) is None
    assert not ResultCache(10, max_bytes=0).enabled


def test_service_repeat_runs_no_stage_and_equals_the_first_answer(service_env):
    sh = service_env
    app = create_app(settings(sh["index"], result_cache_entries=100))
    q = sh["captions"][0]
    with TestClient(app) as c, CountingEncoder(app.state.gare.model) as enc:
        first = c.post("/v1/search", json={"query": q, "k": 5}).json()
        assert first["timings_ms"]["cache"] == "miss" and first["batch_size"] == 1 and enc.rows == [1]
        again = c.post("/v1/search", json={"query": "  " + q.upper() + " ", "k": 5}).json()
        assert again["timings_ms"]["cache"] == "result" and again["batch_size"] == 0
        assert all(again["timings_ms"][k] == 0 for k in ("queue", "encode", "ann", "rerank", "rank"))
        assert enc.rows == [1]  # no encoder call
        assert again["results"] == first["results"]
        # other options are another answer: a miss that runs the stages (the embedding cache skips the encoder)
        other = c.post("/v1/search", json={"query": q, "k": 3}).json()
        assert other["timings_ms"]["cache"] == "hit" and other["batch_size"] == 1
        assert [h["id"] for h in other["results"]] == [h["id"] for h in first["results"][:3]]
        # the batch route: the cached query is answered from the cache, the new one runs
        batch = c.post("/v1/search/batch", json={"queries": [q, sh["captions"][1]], "k": 5}).json()
        assert [r["timings_ms"]["cache"] for r in batch["results"]] == ["result", "miss"]
        assert batch["results"][0]["results"] == first["results"]
        state = app.state.gare
        with state.use_version() as v:
            off = S.search(state.model, v, sh["captions"][1], S.SearchOptions(k=5))
        assert [h["id"] for h in batch["results"][1]["results"]] == [h.id for h in off.hits]
        text = c.get("/metrics").text
        assert 'gare_result_cache_lookups_total{result="hit"} 2.0' in text
        assert 'gare_result_cache_lookups_total{result="miss"} 3.0' in text
        assert "gare_result_cache_entries 3.0" in text


def test_reload_never_serves_the_old_versions_results(service_env, tmp_path):
    from gare_build.build import remove
    from tests.service.support import copy_index

    sh = service_env
    idx = copy_index(sh["index"], tmp_path / "index")
    app = create_app(settings(idx, api_keys="k", result_cache_entries=100))
    q = sh["captions"][4]
    with TestClient(app) as c:
        first = c.post("/v1/search", json={"query": q, "k": 16}).json()
        assert 4 in [h["id"] for h in first["results"]]
        assert c.post("/v1/search", json={"query": q, "k": 16}).json()["timings_ms"]["cache"] == "result"
        remove(str(idx), ["4"])
        assert c.post("/v1/admin/reload", headers={"X-API-Key": "k"}).json()["version"] == "v000002"
        assert len(app.state.gare.result_cache) == 0
        r = c.post("/v1/search", json={"query": q, "k": 16}).json()
        assert r["timings_ms"]["cache"] != "result" and r["index_version"] == "v000002"
        assert 4 not in [h["id"] for h in r["results"]]


def test_off_while_the_query_bank_records_traffic(service_env, tmp_path):
    sh = service_env
    path = tmp_path / "bank.npy"
    app = create_app(settings(sh["index"], result_cache_entries=100, query_bank_size=8, query_bank_path=path,
                              query_bank_flush_every=1))
    q = sh["captions"][2]
    with TestClient(app) as c:
        assert not app.state.gare.result_cache.enabled
        for _ in range(3):
            assert c.post("/v1/search", json={"query": q, "k": 2}).json()["timings_ms"]["cache"] != "result"
        assert len(app.state.gare.query_bank) == 3  # every repeat reached the bank
    assert np.load(path, allow_pickle=False).shape[0] == 3


def test_a_repeat_reads_no_metadata_and_the_byte_estimate_covers_rendered_hits(service_env):
    """A result-cache answer reuses the hits rendered for the first answer: no metadata read (no SQLite, no
    thread hop); and the entry's byte estimate is at least what tracemalloc measures for those rendered hits."""
    import tracemalloc

    from gare_serve.web.presentation import hit_models

    sh = service_env
    app = create_app(settings(sh["index"], result_cache_entries=100))
    q = sh["captions"][2]
    with TestClient(app) as c:
        state = app.state.gare
        version = state.handle.version
        reads = []
        orig = version.metadata

        def counting(ids):
            reads.append(list(ids))
            return orig(ids)

        version.metadata = counting
        try:
            first = c.post("/v1/search", json={"query": q, "k": 5}).json()
            assert first["timings_ms"]["cache"] == "miss" and len(reads) == 1
            again = c.post("/v1/search", json={"query": q, "k": 5}).json()
            assert again["timings_ms"]["cache"] == "result" and len(reads) == 1  # no second read
            assert again["results"] == first["results"] and first["results"][0]["metadata"]
        finally:
            version.metadata = orig
        rc = state.result_cache
        key = rc.keys()[0]
        res, rendered = rc.lookup(key)
        assert len(rendered) == 5
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        fresh = hit_models(state, version, res)
        used = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        assert fresh == list(rendered)
        assert ResultCache.entry_bytes(key, res, rendered) >= used > 0


def test_a_repeat_hands_out_freshly_signed_media_urls(service_env, tmp_path, monkeypatch):
    """With require_key_for_search the media URLs carry an expiring token: a result-cache answer signs them
    anew, so a repeat an hour later still gives URLs that work (the cached answer's own tokens have expired)."""
    import time as _time

    kf = tmp_path / "keys.txt"
    kf.write_text("k1\n")
    sh = service_env
    app = create_app(settings(sh["index"], result_cache_entries=100, api_keys_file=kf, require_key_for_search=True))
    q, auth = sh["captions"][3], {"X-API-Key": "k1"}
    with TestClient(app) as c:
        first = c.post("/v1/search", json={"query": q, "k": 3}, headers=auth).json()
        assert first["timings_ms"]["cache"] == "miss"
        now = _time.time()
        monkeypatch.setattr(_time, "time", lambda: now + 7200)  # two hours on: the first tokens have expired
        state = app.state.gare
        old = first["results"][0]
        assert not state.media.verify(old["id"], old["video_url"].split("token=")[1])
        again = c.post("/v1/search", json={"query": q, "k": 3}, headers=auth).json()
        assert again["timings_ms"]["cache"] == "result"
        assert [h["id"] for h in again["results"]] == [h["id"] for h in first["results"]]
        for h in again["results"]:
            for url in (h["video_url"], h["thumbnail_url"]):
                assert state.media.verify(h["id"], url.split("token=")[1]), url
        assert c.get(again["results"][0]["thumbnail_url"]).status_code == 200
