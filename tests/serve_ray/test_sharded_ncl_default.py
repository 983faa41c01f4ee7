"""Issue 28 on a sharded index, the serving half: gare-serve's app over a sharded index (the Ray ingress's app:
gare_serve.ray_serve.ingress_state with its shards in this process, gare_serve.ray_serve.shard_replica.LocalShards) follows the NCL
default the builder recorded in every shard (biases.default) when a request leaves `ncl` out, exactly as the
single-index service does; a request's `ncl` overrides it either way, and GET /v1/index says which default applies
and why. A generation whose shards hold different decisions is refused. Over Ray Serve itself:
test_ray_ingress_follows_the_recorded_default.

The two decisions are made by the real decide path (`gare-index build --shards 2 --ncl-val`, then `gare-index
biases --ncl-val` on a copy) on validation captions built so that the biases win or lose
(tests/indexer/ncl_support.py, from the single index over the same videos, whose biases the global fit
reproduces); nothing here writes a manifest field."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from pathlib import Path

import pytest

from gare.checkpoint import load_model
from gare_index.shards import current_generation
from gare_index.store import IndexFormatError
from gare_serve.app import create_app
from gare_serve.ray_serve.ingress_state import ShardedServiceState, ShardedView
from gare_serve.ray_serve.shard_replica import LocalShards, ShardWorker
from tests.serve_ray.one_cluster import NCL_QUERY as QUERY
from tests.serve_ray.one_cluster import NCL_REQUESTS
from tests.service.support import running_app, settings


@contextlib.asynccontextmanager
async def sharded_client(root: Path, ckpt: Path):
    model, _ = load_model(ckpt, "cpu")
    gen = current_generation(root)
    shards = LocalShards([ShardWorker(root, s, model) for s in range(gen.n_shards)])
    app = create_app(settings(root, recall_sample_rate=0.0),
                     state_factory=functools.partial(ShardedServiceState, client=shards))
    try:
        async with running_app(app) as client:
            yield client
    finally:
        shards.close()


def biased(hits: list[tuple[float, float, float]]) -> bool:
    """(score, psi, bias) per hit: True when every score is psi + bias, False when every score is psi alone (the
    biases are not all ~0, so the two can be told apart)."""
    added = [abs(s - (p + b)) < 1e-4 for s, p, b in hits]
    alone = [abs(s - p) < 1e-4 for s, p, _ in hits]
    assert hits and (all(added) or all(alone)), hits
    assert any(abs(b) > 1e-4 for _, _, b in hits)
    return all(added)


def hits_of(r: dict) -> list[tuple[float, float, float]]:
    return [(h["score"], h["psi_score"], h["bias"]) for h in r["results"]]


def recorded(root: Path) -> dict:
    """The decision the generation records, as the ingress reads it (gare_serve.ray_serve.ingress_state.ShardedView: every
    shard's manifest, checked to agree); the builder's output read back."""
    view = ShardedView(root, current_generation(root), client=None, expect_sha=None)  # type: ignore[arg-type]
    return view.manifest.biases["default"]


@pytest.mark.parametrize("name", ["on", "off"])
def test_sharded_service_follows_the_recorded_default(decided, name):
    d = recorded(decided[name])
    assert d["on"] is (name == "on")

    async def go():
        async with sharded_client(decided[name], decided["checkpoint"]) as c:
            info = (await c.get("/v1/index")).json()
            plain = (await c.post("/v1/search", json={"query": QUERY})).json()
            forced = [(await c.post("/v1/search", json={"query": QUERY, "ncl": x})).json() for x in (True, False)]
            batch = (await c.post("/v1/search/batch", json={"queries": [QUERY, "a blue square rises"]})).json()
            return info, plain, forced, batch

    info, plain, (yes, no), batch = asyncio.run(go())
    assert info["version"] == ("g000001" if name == "on" else "g000002")
    assert info["ncl_default"] is d["on"] and info["ncl_default_reason"] == d["reason"]
    assert "source" not in info["biases"]["default"]  # GET /v1/index keeps the server's paths to itself
    assert biased(hits_of(plain)) is d["on"] and plain["ncl"] is d["on"]
    assert biased(hits_of(yes)) is True and yes["ncl"] is True  # the request's flag overrides, either way
    assert biased(hits_of(no)) is False and no["ncl"] is False
    assert [biased(hits_of(x)) for x in batch["results"]] == [d["on"], d["on"]]


def test_a_generation_of_two_decisions_is_not_served(decided):
    with pytest.raises(IndexFormatError, match=r"NCL defaults \(biases.default\) differ"):
        ShardedView(decided["mixed"], current_generation(decided["mixed"]), client=None, expect_sha=None)  # type: ignore[arg-type]


def test_ray_ingress_follows_the_recorded_default(decided, ray_cluster):
    """The same over Ray Serve (the suite's one Ray run, app ``ncl``: tests/serve_ray/one_cluster.py, two nodes bound
    to 127.0.0.1, in a private network namespace when root): the "on" index (the search's own default is off) serves
    psi + biases when the request leaves ncl out, psi alone when it says false."""
    got = ray_cluster["apps"]["ncl"]["steps"]["answers"]["answers"]
    assert [a["qi"] for a in got] == [0, 1, 2] and NCL_REQUESTS[1]["ncl"] is False and NCL_REQUESTS[2]["ncl"] is True
    assert all(a["status"] == 200 and a["partial"] is False for a in got), got
    # a hit: [file name, id, score, ann, psi, bias]
    plain, no, yes = ([(h[2], h[4], h[5]) for h in a["hits"]] for a in got)
    assert recorded(decided["on"])["on"] is True
    assert biased(plain) is True and biased(no) is False and biased(yes) is True
