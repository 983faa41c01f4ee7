"""Signed media URLs across processes: one secret per deployment, strict tokens, rotation (gare_serve.media.signing)."""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import os
import stat
import subprocess
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from gare_serve.app import create_app
from gare_serve.engine.startup import StartupError
from gare_serve.media.signing import (
    SECRET_FILE,
    MediaSecretError,
    MediaSigner,
    load_or_create_secret,
    resolve_secrets,
)
from tests.conftest import require
from tests.service.support import copy_index, settings

KEY = "media-test-key"
A = "a" * 40
B = "b" * 40


def test_token_round_trip_and_binding():
    s = MediaSigner([A.encode()], ttl_s=60)
    tok = s.token(7, now=1_000_000)
    assert s.verify(7, tok, now=1_000_000)
    assert not s.verify(8, tok, now=1_000_000)  # bound to the video id
    assert not s.verify(7, tok, now=1_000_061)  # expired
    exp, sig = tok.split(".")
    assert not s.verify(7, f"{int(exp) + 1}.{sig}", now=1_000_000)  # expiry is signed
    assert not MediaSigner([B.encode()]).verify(7, tok, now=1_000_000)  # another deployment's secret


@pytest.mark.parametrize("token", [
    "²." + "A" * 43, "1" * 4301 + "." + "A" * 43, "0001." + "A" * 43, "-5." + "A" * 43, "+5." + "A" * 43,
    " 5." + "A" * 43, "5 ." + "A" * 43, "٣." + "A" * 43, "5." + "A" * 42 + "=", "5." + "é" * 43, "", ".", "..",
    "5.", "." + "A" * 43, "5." + "A" * 43 + "\n", "\x00", "9" * 13 + "." + "A" * 43,
])
def test_malformed_tokens_are_refused_not_raised(token):
    assert MediaSigner([A.encode()]).verify(1, token) is False


@hsettings(max_examples=400, deadline=None)
@given(st.text(max_size=200))
def test_any_string_is_a_clean_refusal(token):
    """Property: verify() returns False for any string it did not sign, and never raises."""
    s = MediaSigner([A.encode()])
    assert s.verify(3, token) is False


@hsettings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(token=st.text(max_size=80) | st.from_regex(r"[0-9²³¹٠-٩]{1,5000}\.[A-Za-z0-9_-]{43}", fullmatch=True))
def test_any_token_is_401_over_http(media_app, token):
    """Over HTTP a malformed or forged token is a 401, never a 5xx (the old code: int('²') raised, 500)."""
    c = media_app
    r = c.get("/v1/videos/0/thumbnail", params={"token": token})
    assert r.status_code == 401, (token, r.status_code, r.text)


@pytest.fixture(scope="module")
def media_app(service_env, tmp_path_factory):
    idx = copy_index(service_env["index"], tmp_path_factory.mktemp("media") / "index")
    app = create_app(settings(idx, api_keys=KEY, require_key_for_search=True))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def test_unicode_digit_expiry_was_a_500_and_is_now_401(media_app):
    for tok in ("²." + "A" * 43, "1" * 4301 + "." + "A" * 43):
        r = media_app.get("/v1/videos/0/file", params={"token": tok})
        assert r.status_code == 401, r.text


def test_rotation_accepts_the_previous_secret_until_dropped():
    old, new = MediaSigner([A.encode()]), MediaSigner([B.encode(), A.encode()])
    tok_old, tok_new = old.token(5), new.token(5)
    assert new.verify(5, tok_old) and new.verify(5, tok_new)  # grace period: both
    assert not MediaSigner([B.encode()]).verify(5, tok_old)  # previous dropped: old tokens refused
    assert not old.verify(5, tok_new)  # new tokens are signed with the new secret
    keys = resolve_secrets(secret=B, secret_file=None, previous=A, index_dir=None)
    assert keys == [B.encode(), A.encode()]


def test_secret_sources_and_their_errors(tmp_path):
    f = tmp_path / "secret"
    f.write_text(B + "\n")
    assert resolve_secrets(secret="", secret_file=f, previous="", index_dir=tmp_path / "nope") == [B.encode()]
    assert resolve_secrets(secret=A, secret_file=f, previous="", index_dir=None) == [A.encode()]  # setting first
    with pytest.raises(MediaSecretError, match="at least 32"):
        resolve_secrets(secret="short", secret_file=None, previous="", index_dir=None)
    with pytest.raises(MediaSecretError, match="cannot read the media secret file"):
        resolve_secrets(secret="", secret_file=tmp_path / "missing", previous="", index_dir=None)
    with pytest.raises(MediaSecretError, match="GARE_MEDIA_SECRET"):
        resolve_secrets(secret="", secret_file=None, previous="", index_dir=None)


def test_generated_secret_is_private_and_shared_by_racing_processes(tmp_path):
    ctx = mp.get_context("spawn")
    with cf.ProcessPoolExecutor(4, mp_context=ctx) as pool:
        # the library function itself: a spawned child imports its light module, not this test module (fastapi, torch)
        got = list(pool.map(load_or_create_secret, [str(tmp_path)] * 8))
    assert len(set(got)) == 1 and len(got[0]) >= 32
    p = tmp_path / SECRET_FILE
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    assert [x.name for x in tmp_path.iterdir()] == [SECRET_FILE]  # no temporary file left behind
    assert load_or_create_secret(tmp_path) == got[0]  # read, not regenerated


def test_read_only_index_without_a_secret_refuses_to_start(service_env, tmp_path):
    """A replica that cannot create the shared secret must not invent its own (its URLs would fail elsewhere)."""
    require(os.geteuid() == 0 and subprocess.run(["which", "mount"], capture_output=True).returncode == 0,
            "root and mount(8): a read-only tmpfs holds the index")
    ro = tmp_path / "ro"
    ro.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(ro)], check=True)
    try:
        copy_index(service_env["index"], ro / "index")
        # the shared index may already hold a secret generated by an earlier test's server: this replica has none
        (ro / "index" / SECRET_FILE).unlink(missing_ok=True)
        subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True)
        app = create_app(settings(ro / "index", api_keys=KEY, require_key_for_search=True))
        with pytest.raises(StartupError, match="GARE_MEDIA_SECRET"):
            with TestClient(app):
                pass
        # with the secret given, the same read-only index serves
        app = create_app(settings(ro / "index", api_keys=KEY, require_key_for_search=True, media_secret=A))
        with TestClient(app) as c:
            assert c.get("/readyz").status_code == 200
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=False)


# ------------------------------------------------------------------------------- real processes
@pytest.fixture(scope="module")
def two_servers(service_env, tmp_path_factory):
    """`gare-serve --workers 2` and a second one-worker `gare-serve` on one index copy, search needing a key,
    no media secret configured: they must agree through the secret generated next to the index."""
    from tests.service.support import UvicornProcess

    idx = copy_index(service_env["index"], tmp_path_factory.mktemp("media2") / "index")
    env = {"GARE_API_KEYS": KEY, "GARE_REQUIRE_KEY_FOR_SEARCH": "true", "GARE_WORKER_HEALTHCHECK_S": "900",
           "GARE_INDEX_POLL_S": "0.5", "GARE_RESULT_CACHE_ENTRIES": "0"}
    with UvicornProcess(["--index", str(idx), "--workers", "2"], env=env, ready_timeout_s=600) as a, \
            UvicornProcess(["--index", str(idx), "--workers", "1"], env=env, ready_timeout_s=600) as b:
        yield a, b, idx


def test_signed_urls_work_on_every_worker_and_replica(two_servers, service_env):
    """200 of 200 media fetches of URLs that a search returned succeed, whichever process gets the fetch
    (new connection each, so they spread over A's two workers; every other one goes to B)."""
    import httpx

    a, b, _ = two_servers
    auth = {"X-API-Key": KEY}
    urls = []
    for i, q in enumerate(service_env["captions"][:10]):
        srv = (a, b)[i % 2]
        r = httpx.post(srv.base_url + "/v1/search", json={"query": q, "k": 5}, headers=auth, timeout=60)
        assert r.status_code == 200, r.text
        urls += [h[u] for h in r.json()["results"] for u in ("thumbnail_url", "video_url")]
    assert len(urls) == 100

    def fetch(i):
        srv = (a, b)[i % 2]  # the URL from a search on one process fetched from every process
        with httpx.Client(base_url=srv.base_url, timeout=60) as c:
            return c.get(urls[i % len(urls)], headers={"Range": "bytes=0-99"}).status_code

    with cf.ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(fetch, range(200)))
    assert codes.count(200) + codes.count(206) == 200, codes
    pids = {w["pid"] for w in httpx.get(a.base_url + "/readyz", timeout=10).json()["workers"]}
    assert len(pids) == 2


def test_every_process_follows_a_new_build_under_load(two_servers, service_env):
    """After a build writes a new CURRENT, both servers (all three worker processes) answer from it within
    the poll after it, with no failed request; the wait is a hang guard (10x the poll plus the time to open a
    version on a quiet machine), not a speed bound: a loaded runner is several times slower."""
    import threading

    import httpx

    from gare_build.build import remove

    a, b, idx = two_servers
    auth = {"X-API-Key": KEY}
    stop = threading.Event()
    seen: list[tuple[float, str, int, str | None]] = []

    def load(srv):
        with httpx.Client(base_url=srv.base_url, timeout=60, headers=auth) as c:
            i = 0
            while not stop.is_set():
                r = c.post("/v1/search", json={"query": service_env["captions"][i % 8], "k": 3})
                seen.append((time.monotonic(), srv.base_url, r.status_code,
                             r.json().get("index_version") if r.status_code == 200 else r.text))
                i += 1

    threads = [threading.Thread(target=load, args=(s,)) for s in (a, a, b)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        before = {v for *_, v in seen}
        remove(str(idx), ["3"])  # a new version, v000002, written and switched to atomically
        t_done = time.monotonic()
        deadline = t_done + 100.0
        on_new: dict[str, bool] = {}
        while time.monotonic() < deadline:
            ra = httpx.get(a.base_url + "/readyz", timeout=10).json()
            rb = httpx.get(b.base_url + "/readyz", timeout=10).json()
            versions = {w["version"] for w in ra.get("workers", [])} | {rb.get("index_version")}
            if versions == {"v000002"} and len(ra.get("workers", [])) == 2:
                on_new["all"] = True
                break
            time.sleep(0.1)
        switched_after = time.monotonic() - t_done
        time.sleep(1.5)  # keep the load running on the new version
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert before == {"v000001"}
    assert on_new.get("all"), f"not every worker on v000002 within the 100 s guard (after {switched_after:.1f} s)"
    assert all(code == 200 for _, _, code, _ in seen), [s for s in seen if s[2] != 200][:5]
    late = [(u, v) for t, u, _, v in seen if t > t_done + switched_after + 0.5]
    assert late and all(v == "v000002" for _, v in late)


def test_a_version_from_another_checkpoint_is_refused_by_the_follower(service_env, tmp_path):
    """The poll never switches to a version built with another model: it keeps serving, logs once."""
    import asyncio

    from gare_build.build import BuildOptions, build
    from tests.service.support import make_checkpoint, running_app

    idx = copy_index(service_env["index"], tmp_path / "index")
    other = make_checkpoint(tmp_path / "other.safetensors", seed=5)
    app = create_app(settings(idx, index_poll_s=0.2))

    async def go():
        async with running_app(app) as c:
            assert (await c.get("/v1/index")).json()["version"] == "v000001"
            await asyncio.to_thread(build, str(other), str(service_env["videos"]), str(idx),
                                    BuildOptions(workers=0, progress=False))
            assert (Path(idx) / "CURRENT").read_text().strip() == "v000002"
            await asyncio.sleep(1.5)
            assert (await c.get("/v1/index")).json()["version"] == "v000001"
            r = await c.post("/v1/search", json={"query": "a", "k": 2})
            assert r.status_code == 200 and r.json()["index_version"] == "v000001"
    asyncio.run(go())
