"""Issue 28: the service follows the index's own NCL default (manifest biases.default, decided by `gare-index
biases --ncl-val` on validation captions built so the biases win or lose for a known reason); a request's `ncl`
still overrides; an index without a decision keeps the search's NCL_DEFAULT. Through the real HTTP app."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from gare_build.cli import main
from gare_index.store import open_index
from gare_search.search import NCL_DEFAULT, NCL_DEFAULT_REASON
from gare_serve.app import create_app
from tests.indexer.ncl_support import flip_manifests
from tests.service.support import copy_index, settings


@pytest.fixture(scope="module")
def decided(service_env, tmp_path_factory):
    root = tmp_path_factory.mktemp("ncl_default")
    lose, win, _ = flip_manifests(service_env["checkpoint"], service_env["index"], root / "val")
    out = {}
    for name, man in (("on", win), ("off", lose)):
        idx = copy_index(service_env["index"], root / name)
        assert main(["biases", "--out", str(idx), "--ncl-val", str(man)]) == 0
        out[name] = idx
    return out


def _hits_biased(r: dict) -> bool:
    """Every hit's score is psi + bias (biases added) or psi alone (not), and the response says which."""
    added = [abs(h["score"] - (h["psi_score"] + h["bias"])) < 1e-4 for h in r["results"]]
    alone = [abs(h["score"] - h["psi_score"]) < 1e-4 for h in r["results"]]
    assert all(added) or all(alone)
    assert any(abs(h["bias"]) > 1e-4 for h in r["results"])  # the two can be told apart
    assert r["ncl"] is all(added)
    return all(added)


@pytest.mark.parametrize("name", ["on", "off"])
def test_service_default_follows_the_index(decided, name):
    d = open_index(decided[name]).manifest["biases"]["default"]
    assert d["on"] is (name == "on")
    with TestClient(create_app(settings(decided[name]))) as c:
        info = c.get("/v1/index").json()
        assert info["ncl_default"] is d["on"] and info["ncl_default_reason"] == d["reason"]
        r = c.post("/v1/search", json={"query": "a red circle moves left"}).json()
        assert _hits_biased(r) is d["on"]
        # the request flag overrides the index's default, either way
        assert _hits_biased(c.post("/v1/search", json={"query": "a red circle moves left", "ncl": True}).json())
        assert not _hits_biased(c.post("/v1/search", json={"query": "a red circle moves left", "ncl": False}).json())
        b = c.post("/v1/search/batch", json={"queries": ["a red circle", "a blue square rises"]}).json()
        assert [_hits_biased(x) for x in b["results"]] == [d["on"], d["on"]]


def test_index_without_a_decision_keeps_the_search_default(service_env):
    with TestClient(create_app(settings(service_env["index"]))) as c:
        info = c.get("/v1/index").json()
        assert info["ncl_default"] is NCL_DEFAULT and info["ncl_default_reason"] == NCL_DEFAULT_REASON
        assert _hits_biased(c.post("/v1/search", json={"query": "a red circle"}).json()) is NCL_DEFAULT
