"""gare-serve's app over a sharded index with its shards in this process (gare_serve.ray_serve.ingress_state +
gare_serve.ray_serve.shard_replica.LocalShards): the HTTP answers equal the single index's for text, example and image
queries; a shard that does not answer is a 503 naming it, or a flagged partial answer; a generation switch moves
the ingress and the shards together. The same app runs on Ray Serve in test_ray_serve.py."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import io
import json
from pathlib import Path

import pytest
from PIL import Image

from gare.checkpoint import load_model
from gare_index.shards import current_generation, write_generation
from gare_serve.app import create_app
from gare_serve.ray_serve.ingress_state import ShardedServiceState, follow_generations
from gare_serve.ray_serve.shard_replica import LocalShards, ShardWorker
from tests.serve_ray.support import assert_same, make_sharded_env
from tests.service.support import running_app, settings

COUNTS = (1, 2, 3)


@pytest.fixture(scope="module")
def env(service_env, tmp_path_factory):
    return make_sharded_env(service_env, tmp_path_factory.mktemp("serve-sharded"), COUNTS)


@contextlib.asynccontextmanager
async def sharded_client(root: Path, ckpt: Path, *, allow_partial: bool = False, **kw):
    model, _ = load_model(ckpt, "cpu")
    gen = current_generation(root)
    shards = LocalShards([ShardWorker(root, s, model) for s in range(gen.n_shards)])
    app = create_app(settings(root, recall_sample_rate=0.0, **kw),
                     state_factory=functools.partial(ShardedServiceState, client=shards, allow_partial=allow_partial),
                     follow=follow_generations)
    try:
        async with running_app(app) as client:
            yield client, shards, app
    finally:
        shards.close()


def png(color=(200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (48, 40), color).save(buf, "PNG")
    return buf.getvalue()


async def ask_all(client, captions, example_ids):
    out = {}
    for i, q in enumerate(captions[:4]):
        r = await client.post("/v1/search", json={"query": q, "k": 5, "candidates": 8})
        assert r.status_code == 200, r.text
        out[f"text{i}"] = r.json()
    r = await client.post("/v1/search/batch", json={"queries": captions[4:7], "k": 4, "candidates": 6, "rerank": False})
    assert r.status_code == 200, r.text
    out["batch"] = r.json()
    r = await client.post("/v1/search", json={"video_ids": example_ids, "k": 5, "candidates": 8})
    assert r.status_code == 200, r.text
    out["example"] = r.json()
    r = await client.post("/v1/search/image", files={"image": ("x.png", png(), "image/png")}, data={"k": "5"})
    assert r.status_code == 200, r.text
    out["image"] = r.json()
    return out


async def ids_of(client, names):
    """The ids this index gives the files `names` (the two indexes number them differently)."""
    r = await client.post("/v1/search/image", files={"image": ("x.png", png(), "image/png")},
                          data={"k": "16", "candidates": "16"})
    table = {h["metadata"]["name"]: h["id"] for h in r.json()["results"]}
    return [table[n] for n in names]


@pytest.mark.parametrize("n", COUNTS)
def test_http_answers_equal_the_single_index(env, n):
    async def go():
        async with running_app(create_app(settings(env["single"]))) as single:
            names = [h["metadata"]["name"] for h in
                     (await single.post("/v1/search/image", files={"image": ("x.png", png((20, 200, 90)), "image/png")},
                                        data={"k": "2"})).json()["results"]]
            want = await ask_all(single, env["captions"], await ids_of(single, names))
        async with sharded_client(env["sharded"][n], env["checkpoint"]) as (client, _, _):
            got = await ask_all(client, env["captions"], await ids_of(client, names))
            info = (await client.get("/v1/index")).json()
            ready = (await client.get("/readyz")).json()
        return want, got, info, ready

    want, got, info, ready = asyncio.run(go())
    for key in want:
        w, g = want[key], got[key]
        if key == "batch":
            for a, b in zip(w["results"], g["results"], strict=True):
                assert_same(a["results"], b["results"])
                assert b["partial"] is False and b["missing_shards"] == []
            continue
        assert_same(w["results"], g["results"])
        assert g["partial"] is False and g["missing_shards"] == [] and w["partial"] is False
        assert g["index_version"] == "g000001"
    assert info["n"] == 16 and info["version"] == "g000001" and ready["index_version"] == "g000001"
    # metadata by global id, through the shards
    assert got["text0"]["results"][0]["metadata"]["id"] == got["text0"]["results"][0]["id"]


def test_missing_shard_is_503_or_a_flagged_partial_answer(env):
    root = env["sharded"][3]
    q = env["captions"][0]

    async def go(allow_partial):
        async with sharded_client(root, env["checkpoint"], allow_partial=allow_partial) as (client, shards, _):
            full = (await client.post("/v1/search", json={"query": q, "k": 16, "candidates": 16})).json()
            shards.down.add(1)
            r = await client.post("/v1/search", json={"query": q, "k": 16, "candidates": 16})
            img = await client.post("/v1/search/image", files={"image": ("x.png", png(), "image/png")}, data={"k": "5"})
            shards.down.clear()
            back = (await client.post("/v1/search", json={"query": q, "k": 16, "candidates": 16})).json()
            return full, r, img, back

    full, r, img, back = asyncio.run(go(False))
    assert r.status_code == 503 and "shards [1]" in r.json()["detail"], r.text
    assert img.status_code == 503 and "shards [1]" in img.json()["detail"]
    assert back["results"] == full["results"] and back["partial"] is False

    full, r, img, back = asyncio.run(go(True))
    assert r.status_code == 200 and img.status_code == 200
    body = r.json()
    assert body["partial"] is True and body["missing_shards"] == [1]
    assert img.json()["partial"] is True and img.json()["missing_shards"] == [1]
    # the others' answer: every video of the full answer except shard 1's, in the same order with the same scores
    assert body["results"] and all(h["id"] % 3 != 1 for h in body["results"])
    assert [(h["id"], h["score"]) for h in body["results"]] == [
        (h["id"], h["score"]) for h in full["results"] if h["id"] % 3 != 1]


def test_generation_switch_moves_every_request_to_the_new_generation(env, tmp_path):
    import shutil

    root = shutil.copytree(env["sharded"][2], tmp_path / "idx", symlinks=True)
    q = env["captions"][1]

    async def go():
        async with sharded_client(root, env["checkpoint"], index_poll_s=0.1) as (client, _, app):
            first = (await client.post("/v1/search", json={"query": q, "k": 3})).json()
            gen = current_generation(root)
            write_generation(root, list(gen.versions))  # generation 2 (same shard versions)
            for _ in range(100):
                await asyncio.sleep(0.1)
                if app.state.gare.handle.version.name == "g000002":
                    break
            second = (await client.post("/v1/search", json={"query": q, "k": 3})).json()
            return first, second

    first, second = asyncio.run(go())
    assert first["index_version"] == "g000001" and second["index_version"] == "g000002"
    assert [h["id"] for h in first["results"]] == [h["id"] for h in second["results"]]


class PickledShards(LocalShards):
    """LocalShards whose calls cross a pickle boundary both ways, as the Ray handles' do (a compiled filter in the
    options travels to every shard replica)."""

    def call(self, method, args, timeout_s=None):
        import pickle

        got = super().call(method, pickle.loads(pickle.dumps(dict(args))), timeout_s)
        return pickle.loads(pickle.dumps(got))


@pytest.mark.parametrize("n", (2, 3))
def test_filtered_answers_equal_the_single_index(env, n):
    """The ingress with a filter (the built-in `path` field; text, batch, example and image queries): the same hits
    as the single index with the same filter, every hit passing it, across a pickle boundary to the shards."""
    from gare_index.store import open_index

    with open_index(env["single"]) as v:
        paths = sorted(r["path"] for r in v.all_metadata())[::3]  # 6 of the 16 videos
    # the hand-built shards indexed copies (<root>/videos/s<shard>/<name>): the filter names both files of a video
    names = {Path(p).name for p in paths}
    paths += sorted(str(p) for p in (env["sharded"][n] / "videos").glob("s*/*.mp4") if p.name in names)
    assert len(paths) == 12
    flt = {"path": {"$in": paths}}

    async def ask(client, example_ids):
        out = {}
        for i, q in enumerate(env["captions"][:2]):
            r = await client.post("/v1/search", json={"query": q, "k": 4, "candidates": 8, "filter": flt})
            assert r.status_code == 200, r.text
            out[f"text{i}"] = r.json()["results"]
        r = await client.post("/v1/search/batch", json={"queries": env["captions"][2:4], "k": 3, "filter": flt})
        assert r.status_code == 200, r.text
        for i, one in enumerate(r.json()["results"]):
            out[f"batch{i}"] = one["results"]
        r = await client.post("/v1/search", json={"video_ids": example_ids, "k": 4, "candidates": 8, "filter": flt})
        assert r.status_code == 200, r.text
        out["example"] = r.json()["results"]
        r = await client.post("/v1/search/image", files={"image": ("x.png", png(), "image/png")},
                              data={"k": "4", "filter": json.dumps(flt)})
        assert r.status_code == 200, r.text
        out["image"] = r.json()["results"]
        return out

    async def go():
        async with running_app(create_app(settings(env["single"]))) as single:
            names = [h["metadata"]["name"] for h in (await single.post(
                "/v1/search/image", files={"image": ("x.png", png((20, 200, 90)), "image/png")},
                data={"k": "2"})).json()["results"]]
            want = await ask(single, await ids_of(single, names))
        root = env["sharded"][n]
        model, _ = load_model(env["checkpoint"], "cpu")
        shards = PickledShards([ShardWorker(root, s, model) for s in range(current_generation(root).n_shards)])
        app = create_app(settings(root, recall_sample_rate=0.0),
                         state_factory=functools.partial(ShardedServiceState, client=shards, allow_partial=False),
                         follow=follow_generations)
        try:
            async with running_app(app) as client:
                got = await ask(client, await ids_of(client, names))
        finally:
            shards.close()
        return want, got

    want, got = asyncio.run(go())
    for key in want:
        assert want[key], key
        assert {h["metadata"]["name"] for h in got[key]} <= names, key
        assert_same(want[key], got[key])
