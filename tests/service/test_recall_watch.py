"""Stage-1 recall watched in production (issue 29, must-have 3): gare_serve/engine/recall_watch.py.

A sample of served queries is re-run exactly in the background: the watch's recall must equal a naive
reference (numpy over every stage-1 vector) for the queries it sampled, with a deliberately weak stage 1 (IVF,
one cell probed of four) as well as the flat one (recall exactly 1); the CPU share and the queue stay bounded;
the metrics appear in /metrics (per worker in multiprocess mode); the WARNING fires below the index's target and
not at or above it; a reload moves the watch to the new version. The real service test index (16 mp4 files,
the tiny checkpoint) throughout, plus one synthetic gallery large enough to measure the CPU share on.
"""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import numpy as np
import pytest
from fastapi.testclient import TestClient

from gare_index.ann import AnnIndex, build_index
from gare_index.ann_params import AnnParams
from gare_index.ncl_ann import build_ncl_ann
from gare_index.store import open_index
from gare_search import search as S
from gare_serve.app import create_app
from gare_serve.engine.exact_scan import exact_top
from gare_serve.engine.prometheus import Metrics
from gare_serve.engine.recall_watch import RecallWatch, Sample
from gare_serve.engine.versions import VersionHandle
from tests.service.support import copy_index, settings

KEY = "recall-watch-key-1"


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def _weak(version) -> AnnIndex:
    """IVF over the version's stage-1 vectors, 4 cells, 1 probed: most of each exact top-10 is missed."""
    p = AnnParams("ivf", nlist=4, nprobe=1)
    return AnnIndex(build_index(np.asarray(version.stage1_units), np.asarray(version.ids), p), p)


def _reference(version, q: np.ndarray, *, ncl: bool = False) -> np.ndarray:
    """The naive exact top-10 ids: argsort over every stage-1 vector (+ the biases for the NCL fold)."""
    s = q @ np.asarray(version.stage1_units, dtype=np.float32).T
    if ncl:
        s = s + np.asarray(version.biases, dtype=np.float32)[None, :]
    return np.asarray(version.ids)[np.argsort(-s, axis=1, kind="stable")[:, :10]]


def _drain(watch: RecallWatch) -> list:
    out = []
    while watch.queued():
        out.append(watch.evaluate(watch._queue.popleft()))
    return out


def _wait(cond, timeout=60.0):
    t = time.time() + timeout
    while time.time() < t:
        if cond():
            return True
        time.sleep(0.02)
    return False


@pytest.fixture()
def weak_version(service_env):
    v = open_index(service_env["index"])
    v.ann = _weak(v)  # in memory only: the files stay as they are
    yield v
    v.close()


# ------------------------------------------------------------------------------------------ the recall itself
def test_recall_equals_a_naive_reference_on_a_weak_stage1(weak_version):
    v = weak_version
    st = v.manifest.stage1
    assert st["recall_at"] == 16 and st["recall_target"] == 0.995  # 16 videos: recall@16 of the exact top-10
    q = _unit(np.random.default_rng(0).standard_normal((24, v.dim)).astype(np.float32))
    watch = RecallWatch(lambda: VersionHandle(v), Metrics(), sample_rate=1.0, chunk_bytes=4 * v.dim * 5)  # 5 rows a chunk
    _, served16 = watch.wrap(v).search(q[:12], 16)  # the index's K: the served list is scored
    _, served8 = watch.wrap(v).search(q[12:], 8)  # another K: stage 1 is run again at 16 for the recall
    evs = _drain(watch)
    assert len(evs) == 24 and watch.stats["sampled"] == 24 and watch.stats["evaluated"] == 24
    ref = _reference(v, q)
    for i, ev in enumerate(evs):
        assert np.array_equal(ev.sample.unit, q[i]) and ev.k_target == 16 and ev.stage1 == "cosine"
        assert sorted(ev.exact.tolist()) == sorted(ref[i].tolist())
        served = served16[i] if i < 12 else served8[i - 12]
        assert ev.served_recall == pytest.approx(np.isin(ref[i], served[served >= 0]).mean(), abs=1e-12)
        _, at16 = v.ann.search(q[i : i + 1], 16)
        assert ev.recall == pytest.approx(np.isin(ref[i], at16[0][at16[0] >= 0]).mean(), abs=1e-12)
        assert ev.rerun == (i >= 12)
    recalls = np.array([ev.recall for ev in evs])
    assert recalls.mean() < 0.8 and recalls.min() < 0.5  # weak indeed
    assert all(evs[i].served_recall <= evs[i].recall for i in range(12, 24))  # K=8 holds no more than K=16
    assert watch.rolling_mean() == pytest.approx(recalls.mean())
    # an empty served list (an IVF cell with nothing in it) is a miss, not a skip
    ev = watch.evaluate(Sample(v.name, q[0], np.zeros(0, np.int64), 16))
    assert ev is not None and ev.recall == 0.0 and ev.served_recall == 0.0 and watch.stats["skipped"] == {}


def test_ncl_stage1_is_scored_against_the_exact_cos_plus_b(weak_version):
    v = weak_version
    v.ann_ncl = build_ncl_ann(np.asarray(v.stage1_units), np.asarray(v.biases), np.asarray(v.ids),
                              {"index_type": "ivf", "nlist": 4, "nprobe": 1})
    assert np.abs(np.asarray(v.biases)).max() > 1e-3
    q = _unit(np.random.default_rng(1).standard_normal((12, v.dim)).astype(np.float32))
    watch = RecallWatch(lambda: VersionHandle(v), None, sample_rate=1.0)
    _, served = watch.wrap(v).search(q, 16, ncl_stage1=True)
    evs = _drain(watch)
    ref = _reference(v, q, ncl=True)
    assert not np.array_equal(np.sort(ref, 1), np.sort(_reference(v, q), 1))  # the biases change the top-10
    for i, ev in enumerate(evs):
        assert ev.stage1 == "ncl" and sorted(ev.exact.tolist()) == sorted(ref[i].tolist())
        assert ev.recall == pytest.approx(np.isin(ref[i], served[i][served[i] >= 0]).mean(), abs=1e-12)


def test_exact_top_is_chunked_and_exact():
    rng = np.random.default_rng(2)
    units = _unit(rng.standard_normal((1000, 16)).astype(np.float32))
    ids = rng.permutation(5000)[:1000].astype(np.int64)
    v = SimpleNamespace(stage1_units=units, ids=ids, biases=np.zeros(1000, np.float32))
    q = _unit(rng.standard_normal((1, 16)).astype(np.float32))[0]
    order = np.argsort(-(units @ q))[:10]
    want = ids[order]
    for rows in (1, 7, 64, 1000, 5000):
        got, scores = exact_top(v, q, 10, chunk_rows=rows)
        assert got.tolist() == want.tolist()
        np.testing.assert_allclose(scores, (units @ q)[order], rtol=0, atol=1e-6)  # the scores of those rows


# ------------------------------------------------------------------------------------------ bounds
def _big_version(n=120_000, d=64, seed=3):
    rng = np.random.default_rng(seed)
    units = _unit(rng.standard_normal((n, d)).astype(np.float32))
    manifest = SimpleNamespace(stage1={"recall_target": 0.995, "recall_at": 256})
    v = SimpleNamespace(name="vbig", n=n, dim=d, ids=np.arange(n, dtype=np.int64), stage1_units=units,
                        biases=np.zeros(n, np.float32), manifest=manifest, close=lambda: None)
    return v, rng


def test_cpu_share_is_bounded():
    """Many samples queued, share 0.1: the watch thread's own CPU clock stays within 10% of the wall time."""
    v, rng = _big_version()
    h = VersionHandle(v)
    share = 0.1
    watch = RecallWatch(lambda: h, Metrics(), sample_rate=1.0, cpu_share=share, queue_size=100_000,
                        chunk_bytes=1 << 20)
    q = _unit(rng.standard_normal((2000, v.dim)).astype(np.float32))
    for r in q:
        watch.offer(Sample("vbig", r, np.arange(256, dtype=np.int64), 256))
    watch.start()
    clock = time.pthread_getcpuclockid(watch.thread.ident)
    c0, w0 = time.clock_gettime(clock), time.perf_counter()
    time.sleep(3.0)
    cpu, wall = time.clock_gettime(clock) - c0, time.perf_counter() - w0
    watch.stop()
    done = watch.stats["evaluated"]
    assert done >= 3, watch.stats  # it worked ...
    assert watch.queued() > 0  # ... with more to do the whole time
    assert cpu <= share * wall * 1.15 + 0.02, (cpu, wall, done)  # ... and kept to its share
    assert watch.stats["cpu_s"] <= cpu + 0.02  # the watch's own account does not exceed the clock


def test_queue_drops_instead_of_growing():
    v, rng = _big_version(n=1000)
    h = VersionHandle(v)
    m = Metrics()
    watch = RecallWatch(lambda: h, m, sample_rate=1.0, queue_size=4)
    q = _unit(rng.standard_normal((10, v.dim)).astype(np.float32))
    got = [watch.offer(Sample("vbig", r, np.arange(10, dtype=np.int64), 256)) for r in q]
    assert got == [True] * 4 + [False] * 6 and watch.queued() == 4
    assert watch.stats["sampled"] == 10 and watch.stats["dropped"] == 6
    assert m.registry.get_sample_value("gare_stage1_recall_dropped_total") == 6
    assert m.registry.get_sample_value("gare_stage1_recall_sampled_total") == 10
    # a slow watch (share 0.001) under a flood of served queries: the queue stays at its bound
    watch = RecallWatch(lambda: h, None, sample_rate=1.0, cpu_share=0.001, queue_size=4).start()
    try:
        for _ in range(50):
            watch.observe("vbig", q, np.tile(np.arange(10, dtype=np.int64), (10, 1)), 256, False)
            assert watch.queued() <= 4
    finally:
        watch.stop()
    assert watch.stats["sampled"] == 500 and watch.stats["dropped"] >= 490


def test_sample_rate_is_a_fraction(weak_version):
    v = weak_version
    q = _unit(np.random.default_rng(4).standard_normal((4000, v.dim)).astype(np.float32))
    watch = RecallWatch(lambda: None, None, sample_rate=0.05, queue_size=10_000, seed=0)
    watch.wrap(v).search(q, 16)
    assert 140 <= watch.stats["sampled"] <= 260  # 5% of 4000 = 200
    off = RecallWatch(lambda: None, None, sample_rate=0.0)
    off.wrap(v).search(q, 16)
    assert off.stats["sampled"] == 0


# ------------------------------------------------------------------------------------------ the warning
def _warnings(caplog):
    return [r for r in caplog.records if r.levelno == logging.WARNING and "below the index's target" in r.getMessage()]


def test_warning_below_the_target_only(service_env, weak_version, caplog):
    caplog.set_level(logging.INFO, logger="gare_serve.engine.recall_watch")
    q = _unit(np.random.default_rng(5).standard_normal((16, weak_version.dim)).astype(np.float32))
    # the flat stage 1 the index was built with: recall 1.0 >= 0.995, no warning
    good = open_index(service_env["index"])
    try:
        watch = RecallWatch(lambda: VersionHandle(good), None, sample_rate=1.0, window=10, warn_min_queries=5)
        watch.wrap(good).search(q, 16)
        evs = _drain(watch)
        assert [ev.recall for ev in evs] == [1.0] * 16 and not _warnings(caplog)
    finally:
        good.close()
    # the weak one: below the target after 5 queries, once per interval
    watch = RecallWatch(lambda: VersionHandle(weak_version), None, sample_rate=1.0, window=10, warn_min_queries=5)
    watch.wrap(weak_version).search(q[:4], 16)
    _drain(watch)
    assert watch.rolling_mean() < 0.995 and not _warnings(caplog)  # 4 queries: too few to say
    watch.wrap(weak_version).search(q[4:], 16)
    _drain(watch)
    warned = _warnings(caplog)
    assert len(warned) == 1, [r.getMessage() for r in warned]  # rate-limited: 12 more below, one line
    msg = warned[0].getMessage()
    assert "recall@16 of the exact top-10" in msg and "0.9950" in msg and "--from-bank" in msg
    watch.warn_interval_s = 0.0
    watch.wrap(weak_version).search(q[:1], 16)
    _drain(watch)
    assert len(_warnings(caplog)) == 2


# ------------------------------------------------------------------------------------------ in the service
def test_service_samples_served_queries_and_exports_metrics(service_env, model_and_index, tmp_path):
    model, _, _ = model_and_index
    texts = service_env["captions"][:6]
    app = create_app(settings(service_env["index"], recall_sample_rate=1.0, recall_cpu_share=1.0,
                              recall_warn_min_queries=3))
    with TestClient(app) as c:
        state = app.state.gare
        watch = state.recall_watch
        assert watch is not None and watch.thread.is_alive()
        for t in texts:
            assert c.post("/v1/search", json={"query": t, "k": 5}).status_code == 200
        assert _wait(lambda: watch.stats["evaluated"] == 6 and watch.idle()), watch.stats
        evs = list(watch.recent)
        units = S.unit_rows(S.encode_queries(model, texts))
        version = state.handle.version
        for i, ev in enumerate(evs):
            assert np.allclose(ev.sample.unit, units[i], atol=1e-6)  # the query that was served
            assert ev.sample.k == 16 and not ev.rerun and ev.sample.version == version.name
            assert sorted(ev.exact.tolist()) == sorted(_reference(version, units[i : i + 1])[0].tolist())
            assert ev.recall == 1.0 and ev.served_recall == 1.0  # flat stage 1
        # now a weak stage 1 serves: the recalls the watch reports are the naive ones
        version.ann = _weak(version)
        for t in texts:
            c.post("/v1/search", json={"query": t, "k": 5})
        assert _wait(lambda: watch.stats["evaluated"] == 12 and watch.idle()), watch.stats
        evs = list(watch.recent)[6:]
        ref = _reference(version, units)
        for i, ev in enumerate(evs):
            _, got = version.ann.search(units[i : i + 1], 16)
            assert ev.recall == pytest.approx(np.isin(ref[i], got[0][got[0] >= 0]).mean(), abs=1e-12)
        assert min(ev.recall for ev in evs) < 1.0
        mean = float(np.mean([ev.recall for ev in list(watch.recent)]))
        text = c.get("/metrics").text
    lines = {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln and ln[0] != "#"}
    assert lines['gare_stage1_recall_count{stage1="cosine"}'] == 12
    assert lines['gare_stage1_recall_bucket{le="1.0",stage1="cosine"}'] == 12
    assert lines['gare_stage1_served_recall_count{stage1="cosine"}'] == 12
    assert lines["gare_stage1_recall_mean"] == pytest.approx(mean)
    assert lines["gare_stage1_recall_window_queries"] == 12 and lines["gare_stage1_recall_target"] == 0.995
    assert lines["gare_stage1_recall_sampled_total"] == 12 and lines["gare_stage1_recall_dropped_total"] == 0
    assert lines['gare_stage1_recall_evaluated_total{list="served"}'] == 12
    assert lines["gare_stage1_recall_cpu_seconds_total"] > 0
    assert watch.thread is None  # stopped with the app


def test_off_means_no_thread(service_env):
    app = create_app(settings(service_env["index"], recall_sample_rate=0.0))
    with TestClient(app) as c:
        assert app.state.gare.recall_watch is None
        assert c.post("/v1/search", json={"query": "a red square"}).status_code == 200
        assert "gare_stage1_recall_mean NaN" in c.get("/metrics").text  # no data, not a zero recall


def test_reload_switches_the_watch_to_the_new_version(service_env, tmp_path):
    from gare_build.build import remove

    idx = copy_index(service_env["index"], tmp_path / "index")
    app = create_app(settings(idx, api_keys=KEY, recall_sample_rate=1.0, recall_cpu_share=1.0))
    texts = service_env["captions"]
    with TestClient(app) as c:
        watch = app.state.gare.recall_watch
        for t in texts[:3]:
            c.post("/v1/search", json={"query": t})
        assert _wait(lambda: watch.stats["evaluated"] == 3 and watch.idle())
        old = list(watch.recent)
        assert {ev.sample.version for ev in old} == {"v000001"}
        remove(str(idx), ["3"])  # a new version (15 videos) by the real indexer
        r = c.post("/v1/admin/reload", headers={"X-API-Key": KEY})
        assert r.status_code == 200 and r.json()["version"] == "v000002"
        # a sample served by v000001 and evaluated now is skipped, not scored against v000002
        watch.offer(old[0].sample)
        for t in texts[:4]:
            c.post("/v1/search", json={"query": t})
        assert _wait(lambda: watch.stats["evaluated"] == 7 and watch.idle()), watch.stats
        new = list(watch.recent)[3:]
        assert watch.stats["skipped"] == {"stale": 1}
        assert {ev.sample.version for ev in new} == {"v000002"}
        assert all(3 not in ev.exact.tolist() and ev.k_target == 15 for ev in new)
        v2 = app.state.gare.handle.version
        assert all(sorted(ev.exact.tolist()) == sorted(_reference(v2, ev.sample.unit[None])[0].tolist()) for ev in new)
        text = c.get("/metrics").text
    assert "gare_stage1_recall_window_queries 4.0" in text  # the rolling window restarted with the new version
    assert 'gare_stage1_recall_skipped_total{reason="stale"} 1.0' in text


# ------------------------------------------------------------------------------------------ several workers
def test_multiprocess_gauges_are_per_worker(tmp_path, monkeypatch):
    """prometheus_client's multiprocess mode, as with `gare-serve --workers 2`: two workers (files of pids 101 and
    102, what MultiProcessValue writes) each export their own rolling mean and target (liveall: a pid label, never
    summed); their histograms and counters are summed."""
    from prometheus_client import values

    prom = tmp_path / "prom"
    prom.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(prom))
    for pid, mean in ((101, 0.9), (102, 0.7)):
        monkeypatch.setattr(values, "ValueClass", values.MultiProcessValue(lambda pid=pid: pid))
        m = Metrics()
        m.recall.labels("cosine").observe(mean)
        m.recall_mean.set(mean)
        m.recall_target.set(0.995)
        m.recall_sampled.inc()
    monkeypatch.setattr(values, "ValueClass", values.MultiProcessValue(lambda: 103))  # the worker answering /metrics
    text = Metrics().render().decode()
    assert 'gare_stage1_recall_mean{pid="101"} 0.9' in text and 'gare_stage1_recall_mean{pid="102"} 0.7' in text
    assert 'gare_stage1_recall_mean{pid="103"} NaN' in text  # a worker with nothing evaluated yet: no data
    assert 'gare_stage1_recall_target{pid="101"} 0.995' in text
    assert 'gare_stage1_recall_count{stage1="cosine"} 2.0' in text
    assert "gare_stage1_recall_sampled_total 2.0" in text
