"""The shared engine (engine=shared) with one HTTP worker in this process and the engine in its own process.

The engine is the real one (``gare_serve.processes.engine_process.EngineProcess``, spawned, device cpu); the worker is
the app ``create_app`` builds for engine=shared (``gare_serve.engine.remote_state.EngineClientState``), driven in
process, so what it holds can be read directly. Its answers are compared with the in-process app's on the same index
(bitwise: one query at a time, or one batch request, is searched by the same code in the same batch shape).
"""

from __future__ import annotations

import asyncio
import io
import os
import signal

import pytest

from gare.text_clean import clean_lower
from gare_search import search as S
from gare_serve.app import create_app
from gare_serve.engine.engine_server import EngineState, engine_settings
from gare_serve.engine.engine_wire import EngineVersionGone, prove_and_check
from gare_serve.engine.prometheus import Metrics
from gare_serve.engine.remote_state import EngineClientState, MetadataVersion
from gare_serve.engine.versions import VersionHandle
from gare_serve.processes.engine_process import EngineProcess, resolve_engine
from tests.service.support import answers_here, answers_in_a_fresh_process, copy_index, running_app, settings

KEY = "shared-engine-key"
HANG_S = 300  # hang guards: the engine starts in seconds (a spawned interpreter importing torch on a busy machine)


def _png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (48, 32), (30, 160, 90)).save(buf, format="PNG")
    return buf.getvalue()


# The engine's torch threads, and the in-process reference's: a float tower's and the rerank's bits hold per thread
# count (gare.text_fixed), and on some CPUs (AVX-512 EPYC) they differ in the last bits between 1 and 2 threads
ENGINE_THREADS = 1


def _hits(body: dict) -> list[tuple]:
    return [(h["id"], h["score"], h["ann_score"], h["psi_score"], h["bias"]) for h in body["results"]]


@pytest.fixture(scope="module")
def env(service_env, tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    idx = copy_index(service_env["index"], root / "index")
    run_dir = root / "run"
    run_dir.mkdir()
    common = dict(device="cpu", index_poll_s=0, api_keys=KEY, reload_wait_s=60, recall_sample_rate=0)
    engine = EngineProcess(settings(idx, **common), run_dir, torch_threads=ENGINE_THREADS)
    engine.start()
    try:
        yield dict(idx=idx, run_dir=run_dir, engine=engine, captions=service_env["captions"],
                   worker=settings(idx, engine="shared", run_dir=run_dir, workers=1, worker_healthcheck_s=HANG_S,
                                   **common),
                   local=settings(idx, torch_threads=ENGINE_THREADS, **common))
    finally:
        engine.stop()


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, HANG_S))


def test_engine_mode_resolution():
    assert resolve_engine("auto", "cpu", 4) == "in_process"  # the CPU: each worker searches itself
    assert resolve_engine("auto", "cpu", 1) == "in_process"
    assert resolve_engine("shared", "cpu", 1) == "shared" and resolve_engine("in_process", "cpu", 8) == "in_process"
    with pytest.raises(ValueError, match="sideways"):
        resolve_engine("sideways", "cpu", 2)


def test_engine_settings_are_the_workers_with_the_engine_role(tmp_path):
    w = settings(tmp_path, engine="shared", run_dir=tmp_path, torch_threads=1, batch_queue_size=100,
                 result_cache_entries=50)
    e = engine_settings(w, 6, workers=3)
    assert (e.engine, e.run_dir, e.result_cache_entries, e.torch_threads) == ("in_process", None, 0, 6)
    assert e.batch_queue_size == 300  # what the three workers' own queues held
    assert e.index == w.index and e.batch_max_size == w.batch_max_size and e.text_encoder == w.text_encoder


def test_the_wire_admits_only_a_peer_that_knows_the_key(tmp_path):
    async def go(client_key: bytes) -> dict[str, str]:
        seen: dict[str, str] = {}
        done = asyncio.Event()

        async def handler(r, w):
            try:
                await prove_and_check(r, w, b"k" * 32)
                seen["engine"] = "admitted"
            except (ConnectionError, asyncio.IncompleteReadError):
                seen["engine"] = "refused"
            finally:
                w.close()
                done.set()

        server = await asyncio.start_unix_server(handler, path=str(tmp_path / "s"))
        r, w = await asyncio.open_unix_connection(str(tmp_path / "s"))
        try:
            await prove_and_check(r, w, client_key)
            seen["worker"] = "admitted"
        except (ConnectionError, asyncio.IncompleteReadError):
            seen["worker"] = "refused"
        w.close()
        await done.wait()
        server.close()
        await server.wait_closed()
        return seen

    assert _run(go(b"k" * 32)) == {"engine": "admitted", "worker": "admitted"}
    assert _run(go(b"x" * 32)) == {"engine": "refused", "worker": "refused"}  # each side checks the other


def test_the_engine_keeps_a_replaced_version_for_its_window_then_closes_it(tmp_path):
    class Version:
        def __init__(self, name):
            self.name, self.closed = name, False

        def close(self):
            self.closed = True

    state = EngineState(settings(tmp_path, reload_wait_s=10), Metrics())
    old, state.handle = VersionHandle(Version("v000001")), VersionHandle(Version("v000002"))
    old.acquire()  # a search in flight on the old version
    state.retire_version(old)
    assert state.acquire_named("v000001") is old  # a worker still on it is served from it
    old.release()
    old.release()  # the searches end: the engine's own reference keeps it open
    assert not old.version.closed and old.refs == 1
    until = state.retained["v000001"][1]
    assert state.expire_retained(now=until - 0.5) == [] and not old.version.closed
    assert state.expire_retained(now=until) == ["v000001"] and old.version.closed
    with pytest.raises(EngineVersionGone, match="v000001.*serves v000002"):
        state.acquire_named("v000001")


def test_answers_equal_the_in_process_ones(env):
    """Text (one and a batch), more-like-these and image searches: the same ids and the same score bits."""
    texts = env["captions"][:6]
    png = _png()

    calls = [("/v1/search", {"json": {"query": q, "k": 5}}) for q in texts]
    calls += [("/v1/search/batch", {"json": {"queries": texts[:4], "k": 4}}),
              ("/v1/search", {"json": {"video_ids": [1, 2], "k": 4}}),
              ("/v1/search/image", {"files": {"image": ("a.png", png, "image/png")}, "data": {"k": "5"}})]

    # the reference in a fresh process at the engine's thread count (support.answers_in_a_fresh_process says why)
    local = answers_in_a_fresh_process(env["local"], calls, HANG_S)
    shared = answers_here(env["worker"], calls, HANG_S)
    for a, b in zip(local, shared, strict=True):
        assert a.get("index_version") == b.get("index_version") == "v000001"
        if "results" in a and a["results"] and "rank" not in a["results"][0]:  # the batch: one response per query
            for x, y in zip(a["results"], b["results"], strict=True):
                assert _hits(x) == _hits(y) and x["batch_size"] == y["batch_size"] == 4
        else:
            assert _hits(a) == _hits(b) and len(_hits(a)) > 0
    assert shared[0]["batch_size"] == 1  # the engine's batch, reported by the worker


def test_worker_holds_no_model_and_reports_the_engine(env):
    async def go():
        async with running_app(create_app(env["worker"])) as c:
            state = c._transport.app.state.gare  # the worker's state
            ready = (await c.get("/readyz")).json()
            health = (await c.get("/healthz")).json()
            info = (await c.get("/v1/index")).json()
            return state, ready, health, info

    state, ready, health, info = _run(go())
    assert isinstance(state, EngineClientState)
    assert state.model is None and state.encoder is None and state.query_cache is None
    v = state.handle.version
    assert isinstance(v, MetadataVersion) and not hasattr(v, "ann") and not hasattr(v, "units")
    pid = env["engine"].pid
    assert ready["status"] == "ready" and ready["engine"]["up"] and ready["engine"]["pid"] == pid != os.getpid()
    assert health == {"status": "ok", "engine": {"up": True, "pid": pid}}
    assert info["device"] == "cpu" and info["version"] == "v000001" and info["checkpoint"]["sha256"]
    # its result cache cleans a text as the engine's tokenizer does (CLIP's "lower"), named by the engine: the
    # worker built no tokenizer
    assert state.result_cache.normalize is clean_lower
    assert state.result_cache.key("v", "c", "e", "A  Dog&amp;cat ", "o") == state.result_cache.key("v", "c", "e", "a dog&cat", "o")


def test_auth_and_limits_answer_in_the_worker(env):
    """401, 413 and 422 come from the worker: the engine sees no search for them."""
    s = env["worker"].model_copy(update={"require_key_for_search": True})

    async def go():
        async with running_app(create_app(s)) as c:
            state = c._transport.app.state.gare
            before = (await state.link.call("status"))["queries"]
            codes = [
                (await c.post("/v1/search", json={"query": "a red ball", "k": 3})).status_code,
                (await c.post("/v1/search", json={"query": "x" * 300_000, "k": 3},
                              headers={"Authorization": f"Bearer {KEY}"})).status_code,
                (await c.post("/v1/search", json={"query": "a red ball", "k": 0},
                              headers={"Authorization": f"Bearer {KEY}"})).status_code,
                (await c.post("/v1/admin/reload")).status_code,
            ]
            after = (await state.link.call("status"))["queries"]
            ok = await c.post("/v1/search", json={"query": "a red ball", "k": 3},
                              headers={"Authorization": f"Bearer {KEY}"})
            counted = (await state.link.call("status"))["queries"]
            return codes, before, after, ok.status_code, counted

    codes, before, after, ok, counted = _run(go())
    assert codes == [401, 413, 422, 401]
    assert after == before and ok == 200 and counted == before + 1


def test_reload_moves_engine_and_worker_together(env):
    from gare_build.build import remove

    remove(str(env["idx"]), ["4"])  # writes v000002

    async def go():
        async with running_app(create_app(env["worker"])) as c:
            state = c._transport.app.state.gare
            r = await c.post("/v1/admin/reload", headers={"Authorization": f"Bearer {KEY}"})
            answers = [(await c.post("/v1/search", json={"query": q, "k": 16})).json() for q in env["captions"][:4]]
            status = await state.link.call("status")
            # the engine still holds the version it served before, for requests that started on it ...
            opts = S.SearchOptions(k=16, candidates=16)
            _, old = await state.link.call("texts", 0, "v000001", [(env["captions"][0], opts)])
            # ... and refuses one it does not hold
            with pytest.raises(EngineVersionGone, match="v000009"):
                await state.link.call("texts", 0, "v000009", [(env["captions"][0], opts)])
            return r, answers, status, state.handle.version.name, old

    r, answers, status, view, old = _run(go())
    assert r.status_code == 200 and r.json()["version"] == "v000002", r.text
    assert status["version"] == view == "v000002"
    assert all(a["index_version"] == "v000002" and a["results"] for a in answers)
    assert all(h["id"] != 4 for a in answers for h in a["results"])
    assert 4 in [h.id for h in old[0][0].hits]  # searched on v000001, which still holds entry 4


def test_engine_death_is_503_with_a_clear_message(env):
    """Last in this module: the engine is killed and not restarted here (the supervisor's restart is
    tests/service/test_serve_engine.py's)."""
    engine = env["engine"]

    async def go():
        async with running_app(create_app(env["worker"])) as c:
            q = {"query": env["captions"][0], "k": 5}
            first = await c.post("/v1/search", json=q)
            os.kill(engine.pid, signal.SIGKILL)
            await asyncio.get_running_loop().run_in_executor(None, engine.process.join, 60)
            dead = await c.post("/v1/search", json=q)
            example = await c.post("/v1/search", json={"video_id": 1, "k": 3})
            not_ready = await c.get("/readyz")
            health = await c.get("/healthz")
            return first, dead, example, not_ready, health

    first, dead, example, not_ready, health = _run(go())
    assert first.status_code == 200
    for r in (dead, example):
        assert r.status_code == 503 and "search engine" in r.json()["detail"], r.text
        assert r.headers.get("retry-after") == "1"
    assert not_ready.status_code == 503 and not_ready.json()["engine"]["up"] is False
    assert "search engine" in not_ready.json()["detail"]
    assert health.status_code == 200 and health.json()["engine"]["up"] is False  # liveness: the worker is alive
