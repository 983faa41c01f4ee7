"""What the Ray ingress records of its traffic, in process (gare_serve.ray_serve.ingress_state over
gare_serve.ray_serve.shard_replica.LocalShards, the 2-shard index `gare-index build --shards 2` wrote):

- the stage-1 recall watch measures the WHOLE generation: for every sampled query its exact top-10 and its recall
  equal a naive computation over both shards' stage-1 vectors, with one shard's stage 1 a deliberately weak IVF
  (one cell of four probed) so that recall < 1 is checked exactly, at the served K and at another K (stage 1 run
  again on every shard), and with the NCL fold (cos + b); the metrics appear on the ingress's /metrics;
- the generation's target is its lowest shard target, measured at the shards' recall_at;
- the alarm goes off on the sharded state (ERROR line, gauge, counter) and clears when a new generation is served,
  with no query needed;
- the query bank holds exactly the embeddings t of the text queries served (|t| kept), and `gare-index tune --from-bank` on
  the sharded root takes it and writes a new generation, which the ingress then serves by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import io
import logging
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from gare.checkpoint import load_model
from gare_build.cli import main as gare_index
from gare_index.ann import AnnIndex, build_index
from gare_index.ann_params import AnnParams
from gare_index.ncl_ann import build_ncl_ann
from gare_index.shards import current_generation, global_id, shard_root, write_generation
from gare_index.store import open_version
from gare_search.query import encode_queries, unit_rows
from gare_serve.app import create_app
from gare_serve.engine.recall_watch import Sample
from gare_serve.ray_serve.ingress_state import (
    ShardedServiceState,
    follow_generations,
    generation_target,
    shard_recall_ks,
)
from gare_serve.ray_serve.shard_replica import LocalShards, ShardWorker
from tests.service.support import running_app, settings

WATCH = dict(recall_sample_rate=1.0, recall_cpu_share=1.0)


def png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (48, 40), (200, 30, 30)).save(buf, "PNG")
    return buf.getvalue()


@contextlib.asynccontextmanager
async def sharded_app(root: Path, ckpt: Path, **kw):
    """The ingress app over the shards of ``root`` served in this process: (client, shards, app, model)."""
    model, _ = load_model(ckpt, "cpu")
    shards = LocalShards([ShardWorker(root, s, model) for s in range(current_generation(root).n_shards)])
    app = create_app(settings(root, **kw), state_factory=functools.partial(ShardedServiceState, client=shards),
                     follow=follow_generations)
    try:
        async with running_app(app) as client:
            yield client, shards, app, model
    finally:
        shards.close()


def shard_version(shards: LocalShards, s: int, generation: int):
    return shards.workers[s]._open[generation].version


def weaken(version) -> None:
    """The shard's stage 1 (in memory only) as an IVF of 4 cells with 1 probed, the plain one and the NCL fold:
    most of its top-K is missed."""
    p = AnnParams("ivf", nlist=4, nprobe=1)
    units, ids = np.asarray(version.stage1_units, np.float32), np.asarray(version.ids)
    version.ann = AnnIndex(build_index(units, ids, p, use_gpu=False), p)
    version.ann_ncl = build_ncl_ann(units, np.asarray(version.biases), ids, {"index_type": "ivf", "nlist": 4,
                                                                              "nprobe": 1})


def exact_ncl_stage1(version) -> None:
    """An exact (flat) NCL fold for a shard built without --ncl-stage1, in memory only."""
    version.ann_ncl = build_ncl_ann(np.asarray(version.stage1_units, np.float32), np.asarray(version.biases),
                                    np.asarray(version.ids), {"index_type": "flat"})


def naive(shards: LocalShards, generation: int, unit: np.ndarray, ks: list[int], k_served: int, *, ncl: bool = False):
    """(the generation's exact top-10 GLOBAL ids, the union of every shard's stage-1 top ks[shard], the candidates
    served at K = k_served: the global top k_served by the stage-1 score of the shards' top k_served): numpy over
    every shard's stage-1 vectors, each shard's own stage 1 asked."""
    n = len(shards.workers)
    gids, scores, union, served = [], [], [], []
    for s in range(n):
        v = shard_version(shards, s, generation)
        gids.append(global_id(np.full(v.n, s, np.int64), np.asarray(v.ids, np.int64), n))
        scores.append(np.asarray(v.stage1_units, np.float32) @ unit + (np.asarray(v.biases, np.float32) if ncl else 0.0))
        for k, into in ((ks[s], union), (k_served, served)):
            _, got = v.search(unit[None, :], k, ncl_stage1=ncl)
            into.append(global_id(np.full((got[0] >= 0).sum(), s, np.int64), got[0][got[0] >= 0], n))
    gids, scores, union, served = map(np.concatenate, (gids, scores, union, served))
    exact = gids[np.argsort(-scores, kind="stable")[:10]]
    by_gid = dict(zip(gids.tolist(), scores.tolist(), strict=True))
    return exact, union, np.array(sorted(served.tolist(), key=lambda g: -by_gid[g])[:k_served], np.int64)


def recall(exact: np.ndarray, listed: np.ndarray) -> float:
    return float(np.isin(exact, listed).mean())


async def wait_for(cond, timeout_s: float = 60.0) -> bool:
    for _ in range(int(timeout_s / 0.05)):
        if cond():
            return True
        await asyncio.sleep(0.05)
    return cond()


def metric_lines(text: str) -> dict[str, float]:
    return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln and ln[0] != "#"}


def test_generation_target_is_the_lowest_shard_target():
    def view(*stage1s, n=20):
        return SimpleNamespace(n=n, manifests=[SimpleNamespace(stage1=st) for st in stage1s])

    assert generation_target(view({"recall_target": 0.99, "recall_at": 16},
                                  {"recall_target": 0.95, "recall_at": 16})) == (0.95, 16)
    # an untuned shard leaves the others' target; K the largest recall_at, capped at the generation's size
    assert generation_target(view({"recall_target": 0.99, "recall_at": 32}, None, n=20)) == (0.99, 20)
    assert generation_target(view(None, {}, n=500))[0] is None


def test_sharded_recall_equals_a_naive_reference_with_a_weak_shard(shard_env):
    root, texts = shard_env["n2"], shard_env["captions"][:8]

    async def go():
        async with sharded_app(root, shard_env["checkpoint"], **WATCH) as (client, shards, app, model):
            state = app.state.gare
            watch = state.recall_watch
            view = state.handle.version
            target, kt = generation_target(view)
            ks = shard_recall_ks(view)
            weaken(shard_version(shards, 0, 1))  # shard 1 keeps its flat (exact) stage 1
            exact_ncl_stage1(shard_version(shards, 1, 1))
            for i, t in enumerate(texts):  # at two Ks: the served candidates are the merge's cut at each
                r = await client.post("/v1/search", json={"query": t, "k": 5, "candidates": 16 if i < 4 else 6})
                assert r.status_code == 200, r.text
            assert await wait_for(lambda: watch.stats["evaluated"] == 8 and watch.idle()), watch.stats
            evs = list(watch.recent)
            units = unit_rows(encode_queries(model, texts))
            # the NCL fold, asked of the watch directly (this index was built without --ncl-stage1: no request can)
            ncl = [watch.evaluate(Sample(view.name, units[i], np.zeros(0, np.int64), 0, ncl_stage1=True))
                   for i in range(4)]
            metrics = metric_lines((await client.get("/metrics")).text)
            shards.down.add(1)  # a shard that does not answer the probe: the sample is skipped, never half-measured
            assert watch.evaluate(Sample(view.name, units[0], np.zeros(0, np.int64), 0)) is None
            assert watch.stats["skipped"] == {"shards": 1} and watch.stats["evaluated"] == 12
            shards.down.clear()
            refs = [naive(shards, 1, units[i], ks, 16 if i < 4 else 6) for i in range(8)]
            refs_ncl = [naive(shards, 1, units[i], ks, 16, ncl=True) for i in range(4)]
            return evs, ncl, units, metrics, refs, refs_ncl, (target, kt, ks), [m.stage1 for m in view.manifests]

    evs, ncl, units, metrics, refs, refs_ncl, (target, kt, ks), stage1s = asyncio.run(go())
    assert ks == [st["recall_at"] for st in stage1s] and kt == min(max(ks), 16)  # each shard's own K
    assert target == min(st["recall_target"] for st in stage1s)
    for i, ev in enumerate(evs):
        exact, union, served = refs[i]
        np.testing.assert_allclose(ev.sample.unit, units[i], atol=1e-5)  # the query that was served
        assert ev.sample.version == "g000001" and ev.stage1 == "cosine" and ev.k_target == kt and ev.rerun
        assert sorted(ev.exact.tolist()) == sorted(exact.tolist())
        assert ev.recall == pytest.approx(recall(exact, union), abs=1e-12)
        # the candidates the merge kept at the request's K (16, then 6: at most 6 of the top-10)
        assert ev.served_recall == pytest.approx(recall(exact, served), abs=1e-12)
    assert max(ev.served_recall for ev in evs[4:]) <= 0.6
    recalls = [ev.recall for ev in evs]
    assert min(recalls) < 1.0 and max(recalls) <= 1.0  # the weak shard missed part of some global top-10
    for ev, (exact, union, _) in zip(ncl, refs_ncl, strict=True):  # (stage 1 run again at each shard's K)
        assert ev.stage1 == "ncl" and ev.rerun and sorted(ev.exact.tolist()) == sorted(exact.tolist())
        assert ev.recall == pytest.approx(recall(exact, union), abs=1e-12)
    assert any(set(a[0].tolist()) != set(b[0].tolist()) for a, b in zip(refs_ncl, refs, strict=False))  # b matters
    assert min(ev.recall for ev in ncl) < 1.0
    assert metrics['gare_stage1_recall_count{stage1="cosine"}'] == 8
    assert metrics['gare_stage1_recall_count{stage1="ncl"}'] == 4
    assert metrics['gare_stage1_recall_evaluated_total{list="rerun"}'] == 8 + 4
    assert metrics["gare_stage1_recall_target"] == pytest.approx(target)
    assert metrics["gare_stage1_recall_mean"] == pytest.approx(np.mean(recalls + [ev.recall for ev in ncl]))


def test_alarm_on_the_sharded_state_clears_on_a_new_generation(shard_env, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="gare_serve.engine.recall_watch")
    root = shutil.copytree(shard_env["n2"], tmp_path / "idx", symlinks=True)
    texts = shard_env["captions"][:6]

    async def go():
        async with sharded_app(root, shard_env["checkpoint"], index_poll_s=0.1, recall_alarm_after_s=0.0,
                               recall_warn_min_queries=3, recall_window=6, **WATCH) as (client, shards, app, _):
            watch = app.state.gare.recall_watch
            for s in range(2):
                weaken(shard_version(shards, s, 1))
            for t in texts:
                assert (await client.post("/v1/search", json={"query": t, "k": 5})).status_code == 200
            assert await wait_for(lambda: watch.stats["evaluated"] == 6 and watch.idle()), watch.stats
            on = metric_lines((await client.get("/metrics")).text)
            low = watch.rolling_mean()
            write_generation(root, list(current_generation(root).versions))  # g000002: the same (flat) shard versions
            assert await wait_for(lambda: app.state.gare.handle.version.name == "g000002")
            # no query since the switch: the idle watch has cleared the alarm by itself
            assert await wait_for(lambda: not watch.alarmed, timeout_s=10.0)
            off = metric_lines((await client.get("/metrics")).text)
            for t in texts[:3]:
                assert (await client.post("/v1/search", json={"query": t, "k": 5})).status_code == 200
            assert await wait_for(lambda: watch.stats["evaluated"] == 9 and watch.idle()), watch.stats
            after = metric_lines((await client.get("/metrics")).text)
            return on, low, off, after, [ev.recall for ev in list(watch.recent)[6:]]

    on, low, off, after, recalls = asyncio.run(go())
    assert low < 0.995
    assert on["gare_stage1_recall_alarm"] == 1 and on["gare_stage1_recall_alarms_total"] == 1
    alarms = [r for r in caplog.records if r.levelno == logging.ERROR and "stage-1 recall alarm" in r.getMessage()]
    assert len(alarms) == 1 and "of g000001" in alarms[0].getMessage() and "--from-bank" in alarms[0].getMessage()
    assert off["gare_stage1_recall_alarm"] == 0 and off["gare_stage1_recall_window_queries"] == 0
    assert recalls == [1.0, 1.0, 1.0]  # the new generation's flat stage 1 is exact
    assert after["gare_stage1_recall_alarm"] == 0 and after["gare_stage1_recall_alarms_total"] == 1
    assert after["gare_stage1_recall_mean"] == 1.0


def test_bank_on_the_ingress_feeds_a_sharded_tune_the_ingress_then_serves(shard_env, tmp_path):
    root = shutil.copytree(shard_env["n2"], tmp_path / "idx", symlinks=True)
    bank = tmp_path / "bank" / "queries.npy"
    texts = shard_env["captions"][:12]

    async def go():
        async with sharded_app(root, shard_env["checkpoint"], index_poll_s=0.1, recall_sample_rate=0.0,
                               query_bank_size=100, query_bank_path=bank,
                               query_bank_flush_every=len(texts)) as (client, _, app, model):
            for t in texts[:8]:
                assert (await client.post("/v1/search", json={"query": t, "k": 3})).status_code == 200
            r = await client.post("/v1/search/batch", json={"queries": texts[8:], "k": 3})
            assert r.status_code == 200, r.text
            img = await client.post("/v1/search/image", files={"image": ("x.png", png(), "image/png")})
            assert img.status_code == 200, img.text
            written = np.load(bank, allow_pickle=False)  # flushed at the 12th query, while serving
            rc = gare_index(["tune", "--out", str(root), "--from-bank", str(bank), "--recall-target", "0.9"])
            assert rc == 0
            assert await wait_for(lambda: app.state.gare.handle.version.name == "g000002")
            answer = (await client.post("/v1/search", json={"query": texts[0], "k": 3})).json()
            return written, encode_queries(model, texts).numpy(), answer  # t as served, |t| kept

    written, want, answer = asyncio.run(go())
    assert written.shape == (12, want.shape[1]) and written.dtype == np.float32
    np.testing.assert_allclose(written, want, rtol=1e-5, atol=1e-5)  # the served text queries, in order; no image query
    assert texts[0].encode() not in bank.read_bytes()  # embeddings only
    gen = current_generation(root)
    assert gen.number == 2 and answer["index_version"] == "g000002"
    for s, name in enumerate(gen.versions):
        with open_version(shard_root(root, s), name) as v:
            assert v.manifest["builder"]["command"] == "tune"
            source = v.manifest["stage1"]["query_source"]
            assert source.startswith("query-bank (") and "12 distinct of 12 served" in source, source
