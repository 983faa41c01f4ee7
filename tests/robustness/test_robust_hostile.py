"""Hostile input: the whole API fuzzed from its OpenAPI document (schemathesis), hand-picked hostile requests
(oversized bodies, unicode edge cases, path traversal, odd ids, missing or wrong API keys), pickle payloads
in index and checkpoint files (never executed: a marker file never appears), and hostile video files
(reported and skipped by `gare-index build`), bad manifest rows and arguments, and every status code the
OpenAPI document lists, produced on its route.

Fast (CI): a bounded, derandomised fuzz run (30 examples per operation and mode). Slow: 300 random ones.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import socket
import struct
from pathlib import Path

import httpx
import numpy as np
import pytest

from gare_build.cli import main as index_main
from gare_index.store import IndexFormatError, list_versions, open_index, verify_index
from tests.badfiles import write_bad_videos
from tests.indexer.support import reseal
from tests.robustness.test_robust_common import (
    LIVE_KEY,
    Stopwatch,
    copy_index,
    copy_lib,
    index_cli,
    record,
    running_app,
)
from tests.service.openapi_fuzz import run_fuzz
from tests.service.support import settings as svc_settings

KEY = "robust-hostile-admin-key"


# ============================================================================================ fuzzing
@pytest.fixture(scope="module")
def fuzz_index(robust_env, tmp_path_factory):
    return copy_index(robust_env, tmp_path_factory.mktemp("fuzz") / "index")


def _fuzz_all(fuzz_index, max_examples: int, derandomize: bool) -> dict:
    from gare_serve.app import create_app

    try:
        from schemathesis.python.asgi import shutdown_lifespans
    except ImportError:  # pragma: no cover - older schemathesis
        def shutdown_lifespans():
            return None

    sw = Stopwatch()
    out = {}
    try:
        app = create_app(svc_settings(fuzz_index, api_keys=KEY))
        out["open"] = run_fuzz(app, max_examples=max_examples, derandomize=derandomize)
        out["with_admin_key"] = run_fuzz(app, max_examples=max(5, max_examples // 3), derandomize=derandomize,
                                         headers={"Authorization": f"Bearer {KEY}"}, modes=("positive",))
        app_keyed = create_app(svc_settings(fuzz_index, api_keys=KEY, require_key_for_search=True))
        out["search_needs_key"] = run_fuzz(app_keyed, max_examples=max(5, max_examples // 3), derandomize=derandomize)
    finally:
        shutdown_lifespans()
    out["seconds"] = sw.s
    out["requests"] = sum(v["requests"] for v in out.values() if isinstance(v, dict))
    out["5xx"] = sum(v["5xx"] for v in out.values() if isinstance(v, dict))
    out["failures"] = sum(len(v["failures"]) for v in out.values() if isinstance(v, dict))
    return out


def _assert_fuzz_clean(out: dict) -> None:
    for name in ("open", "with_admin_key", "search_needs_key"):
        r = out[name]
        assert r["5xx"] == 0, (name, r["stats"])
        assert not r["failures"], json.dumps(r["failures"][:5], indent=1)


def test_fuzz_api_from_openapi(fuzz_index):
    out = _fuzz_all(fuzz_index, max_examples=30, derandomize=True)
    record("fuzz_fast", out)
    _assert_fuzz_clean(out)


@pytest.mark.slow
def test_fuzz_api_from_openapi_many_examples(fuzz_index):
    out = _fuzz_all(fuzz_index, max_examples=300, derandomize=False)
    record("fuzz_full", out)
    _assert_fuzz_clean(out)


# ============================================================================================ documented statuses
def _png_bytes() -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


def _status_recipes(vid: int, too_big: int) -> list[tuple[str, int, str, str, str, dict]]:
    """(route as in /openapi.json, status, app, method, url, httpx kwargs): one request per documented status
    of each route. Apps: "open" (admin key set), "keyed" (require_key_for_search), "cold" (lifespan not run:
    not ready), "mismatch" (CURRENT names a version built with another checkpoint)."""
    bad_utf8 = {"content": b'{"query": "\xff"}', "headers": {"content-type": "application/json"}}
    big = {"content": b'{"query": "' + b"a" * too_big + b'"}', "headers": {"content-type": "application/json"}}
    neg_len = {"headers": {"content-length": "-1"}}
    huge_len = {"headers": {"content-length": str(10**9)}}
    admin = {"headers": {"Authorization": f"Bearer {KEY}"}}
    wrong = {"headers": {"X-API-Key": "wrong"}}
    out: list[tuple[str, int, str, str, str, dict]] = []
    for route, url, body in (("POST /v1/search", "/v1/search", {"query": "a red circle", "k": 2}),
                             ("POST /v1/search/batch", "/v1/search/batch", {"queries": ["a red circle"], "k": 2})):
        out += [(route, 200, "open", "POST", url, {"json": body}),
                (route, 400, "open", "POST", url, bad_utf8),
                (route, 401, "keyed", "POST", url, {"json": body}),
                (route, 403, "keyed", "POST", url, {"json": body, **wrong}),
                (route, 409, "open", "POST", url, {"json": {**body, "ncl_stage1": True}}),
                (route, 413, "open", "POST", url, big),
                (route, 422, "open", "POST", url, {"json": {**body, "k": 0}}),
                (route, 503, "cold", "POST", url, {"json": body})]
    out.append(("POST /v1/search", 404, "open", "POST", "/v1/search", {"json": {"video_id": 10**9, "k": 2}}))
    # search by an uploaded image (multipart)
    route, url = "POST /v1/search/image", "/v1/search/image"
    png = {"files": {"image": ("red.png", _png_bytes(), "image/png")}, "data": {"k": "2"}}
    out += [(route, 200, "open", "POST", url, png),
            (route, 400, "open", "POST", url, neg_len),
            (route, 401, "keyed", "POST", url, png),
            (route, 403, "keyed", "POST", url, {**png, **wrong}),
            (route, 413, "open", "POST", url, {"files": {"image": ("big.png", b"\x89PNG" + b"0" * (5 << 20), "image/png")}}),
            (route, 415, "open", "POST", url, {"files": {"image": ("a.txt", b"plain text", "text/plain")}}),
            (route, 422, "open", "POST", url, {**png, "data": {"k": "0"}}),
            (route, 503, "cold", "POST", url, png)]
    for suffix in ("", "/thumbnail", "/file"):
        route = f"GET /v1/videos/{{video_id}}{suffix}"
        out += [(route, 200, "open", "GET", f"/v1/videos/{vid}{suffix}", {}),
                (route, 400, "open", "GET", f"/v1/videos/{vid}{suffix}", neg_len),
                (route, 401, "keyed", "GET", f"/v1/videos/{vid}{suffix}", {}),
                (route, 403, "keyed", "GET", f"/v1/videos/{vid}{suffix}", wrong),
                (route, 404, "open", "GET", f"/v1/videos/{10**9}{suffix}", {}),
                (route, 413, "open", "GET", f"/v1/videos/{vid}{suffix}", huge_len),
                (route, 422, "open", "GET", f"/v1/videos/-1{suffix}", {}),
                (route, 503, "cold", "GET", f"/v1/videos/{vid}{suffix}", {})]
    out += [("GET /v1/videos/{video_id}/thumbnail", 304, "open", "GET", f"/v1/videos/{vid}/thumbnail", {"etag": True}),
            ("GET /v1/videos/{video_id}/file", 206, "open", "GET", f"/v1/videos/{vid}/file", {"headers": {"Range": "bytes=0-9"}}),
            ("GET /v1/videos/{video_id}/file", 416, "open", "GET", f"/v1/videos/{vid}/file",
             {"headers": {"Range": f"bytes={10**12}-"}})]
    route = "GET /v1/index"
    out += [(route, 200, "open", "GET", "/v1/index", {}), (route, 400, "open", "GET", "/v1/index", neg_len),
            (route, 401, "keyed", "GET", "/v1/index", {}), (route, 403, "keyed", "GET", "/v1/index", wrong),
            (route, 413, "open", "GET", "/v1/index", huge_len), (route, 503, "cold", "GET", "/v1/index", {})]
    route = "POST /v1/admin/reload"
    out += [(route, 200, "open", "POST", "/v1/admin/reload", admin),
            (route, 400, "open", "POST", "/v1/admin/reload", {"headers": {**admin["headers"], "content-length": "-1"}}),
            (route, 401, "open", "POST", "/v1/admin/reload", {}), (route, 403, "open", "POST", "/v1/admin/reload", wrong),
            (route, 409, "mismatch", "POST", "/v1/admin/reload", admin),
            (route, 413, "open", "POST", "/v1/admin/reload", {"headers": {**admin["headers"], "content-length": str(10**9)}}),
            (route, 503, "cold", "POST", "/v1/admin/reload", admin)]
    out += [("GET /healthz", 200, "open", "GET", "/healthz", {}), ("GET /readyz", 200, "open", "GET", "/readyz", {}),
            ("GET /readyz", 503, "cold", "GET", "/readyz", {}), ("GET /metrics", 200, "open", "GET", "/metrics", {}),
            ("GET /metrics", 401, "keyed", "GET", "/metrics", {}), ("GET /metrics", 403, "keyed", "GET", "/metrics", wrong)]
    return out


def test_every_documented_status_is_produced_on_its_route(robust_env, tmp_path, figure):
    """The OpenAPI document is a claim: each status code it lists for a route is produced on that route by
    a request that should produce it (and nothing else is listed), each error answers with a JSON detail."""
    from gare_build.build import recompute_biases
    from gare_serve.app import create_app

    idx = copy_index(robust_env, tmp_path / "index")
    v = open_index(idx, use_gpu=False)
    vid, too_big = int(v.ids[0]), svc_settings(idx).max_body_bytes
    v.close()
    recipes = _status_recipes(vid, too_big)
    fig = figure("documented_statuses", rows=[])

    def make(kind: str):
        if kind == "keyed":
            return create_app(svc_settings(idx, api_keys=KEY, require_key_for_search=True))
        return create_app(svc_settings(idx, api_keys=KEY))

    async def call(c, method, url, kw) -> httpx.Response:
        kw = dict(kw)
        if kw.pop("etag", False):
            etag = (await c.get(url)).headers["etag"]
            kw["headers"] = {"If-None-Match": etag}
        return await c.request(method, url, **kw)

    async def go() -> dict:
        doc = make("open").openapi()
        for kind in ("open", "keyed", "cold", "mismatch"):
            app = make(kind)
            mine = [r for r in recipes if r[2] == kind]
            if kind == "cold":  # no lifespan: the service is not ready
                transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
                async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as c:
                    for route, want, _, method, url, kw in mine:
                        r = await call(c, method, url, kw)
                        fig["rows"].append({"route": route, "documented": want, "got": r.status_code,
                                            "detail": r.json().get("detail")})
                continue
            async with running_app(app) as c:
                if kind == "mismatch":  # a new CURRENT version whose manifest names another checkpoint
                    name = recompute_biases(str(idx)).version
                    mpath = idx / "versions" / name / "manifest.json"
                    m = json.loads(mpath.read_text())
                    m["checkpoint"]["sha256"] = "0" * 64
                    mpath.write_text(json.dumps(m))
                    reseal(mpath.parent)  # refused for the checkpoint it names, not for its seal
                for route, want, _, method, url, kw in mine:
                    r = await call(c, method, url, kw)
                    row = {"route": route, "documented": want, "got": r.status_code}
                    if r.status_code >= 400:
                        row["detail"] = r.json().get("detail") if "json" in r.headers.get("content-type", "") else None
                    fig["rows"].append(row)
        return doc

    doc = asyncio.run(go())
    documented = {f"{m.upper()} {p}": {int(c) for c in op["responses"]} for p, ops in doc["paths"].items()
                  for m, op in ops.items()}
    produced: dict[str, set[int]] = {}
    for row in fig["rows"]:
        produced.setdefault(row["route"], set()).add(row["documented"])
    # every error explains itself in JSON, except 416 (Starlette's plain-text answer to an unsatisfiable Range)
    bad = [r for r in fig["rows"] if r["got"] != r["documented"] or (r["got"] >= 400 and r["got"] != 416
                                                                     and not r.get("detail"))]
    assert not bad, bad
    assert documented == produced, {k: (documented.get(k), produced.get(k)) for k in documented.keys() | produced.keys()
                                    if documented.get(k) != produced.get(k)}


# ============================================================================================ hand-picked
def _raw_request(port: int, request: bytes, body_parts: tuple[bytes, ...] = (), timeout: float = 30.0
                 ) -> tuple[int, bytes]:
    """Send exact bytes to 127.0.0.1:port (no client-side URL normalisation); (status, body).

    `body_parts` are sent one by one after `request` until the server answers (a server refusing an oversized
    body answers early and closes; writing on would only get the connection reset)."""
    import select

    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(request)
        for part in body_parts:
            if select.select([s], [], [], 0.02)[0]:
                break  # the answer is already there
            try:
                s.sendall(part)
            except (BrokenPipeError, ConnectionResetError):
                break
        data = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/") else -1
    return status, body


def _get(port: int, path: str, headers: str = "") -> tuple[int, bytes]:
    return _raw_request(port, f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{headers}Connection: close\r\n\r\n".encode("latin-1"))


def _post_raw(port: int, path: str, body: bytes, headers: bytes = b"") -> tuple[int, bytes]:
    req = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
           f"Content-Length: {len(body)}\r\nConnection: close\r\n").encode() + headers + b"\r\n"
    return _raw_request(port, req, tuple(body[i : i + 65536] for i in range(0, len(body), 65536)))


QUERIES = {
    "nul": "a red\x00circle",
    "only_nul": "\x00",
    "rtl_override": "\u202eelcric der a\u202c",
    "rtl_arabic_hebrew": "دائرة حمراء עיגול אדום",
    "emoji_zwj": "👩\u200d👩\u200d👧 🏳️\u200d🌈 a circle",
    "combining": "a" + "\u0301" * 500,
    "zero_width": "\u200b\u200c\u200d\ufeff",
    "bidi_isolates": "\u2066\u2067\u2068x\u2069",
    "max_length": "x" * 512,
    "over_length": "x" * 513,
    "100k_ascii": "a" * 100_000,
    "100k_emoji": "😀" * 100_000,
    "blank_unicode": "\u3000\u2003\n\t",
    "noncharacters": "\ufffe\uffff\U0010ffff",
    "control_chars": "".join(chr(i) for i in range(1, 32)),
    "html_script": "<script>alert(1)</script>",
    "sql": "'; DROP TABLE videos; --",
    "format_string": "%s%s%n{0}{__class__}",
}
# JSON texts sent as is (escapes the encoder would never produce)
RAW_BODIES = {
    "lone_high_surrogate": b'{"query": "\\ud800"}',
    "lone_low_surrogate": b'{"query": "\\udfff x"}',
    "reversed_pair": b'{"query": "\\udc00\\ud800"}',
    "escaped_nul": b'{"query": "a\\u0000b"}',
    "batch_lone_surrogate": b'{"queries": ["ok", "\\ud83d"]}',
    "invalid_utf8": b'{"query": "\xff\xfe\xfa"}',
    "overlong_utf8": b'{"query": "\xc0\xaf"}',
    "deep_nesting": b"[" * 100_000,
    "huge_int": b'{"query": "x", "k": ' + b"9" * 5000 + b"}",
    "huge_float": b'{"query": "x", "k": 1e999999}',
    "nan": b'{"query": "x", "k": NaN}',
    "duplicate_keys": b'{"query": "x", "query": "y"}',
    "not_an_object": b'"just a string"',
    "empty": b"",
    "bom": b'\xef\xbb\xbf{"query": "x"}',
    "oversized_300k": b'{"query": "' + b"a" * 300_000 + b'"}',
}


def _search_post(port: int, path: str, body: bytes) -> tuple[int, bytes]:
    return _post_raw(port, path, body)


def test_hostile_requests_to_the_live_server(live_env, figure):
    srv, idx = live_env["srv"], live_env["index"]
    port = srv.port
    rows = figure("hostile_requests", rows=[])["rows"]

    def check(name: str, status: int, body: bytes, allowed: set[int]) -> None:
        rows.append({"input": name, "status": status})
        assert status in allowed, (name, status, body[:300])
        assert status < 500, (name, status, body[:300])
        if status >= 400:
            assert json.loads(body).get("detail"), (name, body[:300])  # a clear message, as JSON

    # queries with unicode edge cases: answered, or refused with 413/422, never a 5xx
    for name, q in QUERIES.items():
        body = json.dumps({"query": q, "k": 3}).encode()
        st, b = _search_post(port, "/v1/search", body)
        check(f"query:{name}", st, b, {200, 413, 422})
        if st == 200:
            assert json.loads(b)["query"] == q  # echoed exactly (NUL, RTL, emoji survive the round trip)
        st, b = _search_post(port, "/v1/search/batch", json.dumps({"queries": [q, "ok"], "k": 2}).encode())
        check(f"batch:{name}", st, b, {200, 413, 422})
    assert any(r["input"] == "query:100k_ascii" and r["status"] == 422 for r in rows)
    assert any(r["input"] == "query:100k_emoji" and r["status"] == 413 for r in rows)
    for name, raw in RAW_BODIES.items():
        st, b = _search_post(port, "/v1/search" if "batch" not in name else "/v1/search/batch", raw)
        check(f"raw:{name}", st, b, {200, 400, 413, 422})
    # a chunked body over the limit (no Content-Length to trust)
    chunks = [b'{"query": "'] + [b"a" * 65536] * 6 + [b'"}']
    head = (b"POST /v1/search HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
    st, b = _raw_request(port, head, tuple(b"%x\r\n" % len(c) + c + b"\r\n" for c in chunks) + (b"0\r\n\r\n",))
    check("chunked_400k", st, b, {413})
    st, b = _raw_request(port, b"POST /v1/search HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\nConnection: close\r\n\r\n{}")
    rows.append({"input": "negative_content_length", "status": st})
    assert st in (400, 413), st

    # path traversal and odd ids on the video routes: never a file outside the index, never a 5xx
    secret = Path("/etc/passwd").read_bytes()[:20] if Path("/etc/passwd").exists() else b"root:"
    indexed = {p.read_bytes() for p in live_env["lib"].glob("*.mp4")}
    for route in ("", "/file", "/thumbnail"):
        for vid in ("..%2F..%2Fetc%2Fpasswd", "..%2f..%2f..%2f..%2fetc%2fpasswd", "%2e%2e%2f%2e%2e%2fetc%2fpasswd",
                    "..", "...", "-1", "1e9", "0x10", "1.0", "%EF%BC%91", "1%00", "9223372036854775808",
                    "99999999999999999999999999", "%20", "+1", "0b1", "1_0", "NaN", "null", "%2F", "%252e%252e%252f"):
            st, b = _get(port, f"/v1/videos/{vid}{route}")
            check(f"GET /v1/videos/{vid}{route}", st, b, {200, 404, 422})
            assert secret not in b
            if st == 200 and route == "/file":
                assert b in indexed  # "+1", "1_0", ... parse as ids: the indexed file of that id, nothing else
        for path in ("/v1/videos/../../etc/passwd", "/v1/videos/0/../../../etc/passwd", "/static/../../../etc/passwd",
                     "/static/..%2F..%2F..%2Fetc%2Fpasswd", "/static/%2e%2e/%2e%2e/app.py", "//etc/passwd",
                     "/v1/videos/0/file/../../../../etc/passwd", "/v1/videos/0/file?path=/etc/passwd"):
            st, b = _get(port, path)
            rows.append({"input": f"GET {path}", "status": st})
            assert st < 500 and secret not in b, (path, st)
    # a real id's file is the indexed file, whatever the query string says
    st, b = _get(port, "/v1/videos/0/file?path=/etc/passwd&file=../../etc/passwd")
    assert st == 404 or (st == 200 and b in indexed), st

    # API keys on the admin route: 401 without, 403 wrong, 200 right; never a 5xx
    auth_cases = {
        "none": ("", {401}),
        "wrong": (f"Authorization: Bearer {LIVE_KEY}x\r\n", {403}),
        "empty_bearer": ("Authorization: Bearer \r\n", {401}),
        "basic_scheme": (f"Authorization: Basic {LIVE_KEY}\r\n", {401}),
        "key_in_query_only": ("", {401}),
        "long_key": ("Authorization: Bearer " + "k" * 8000 + "\r\n", {403}),
        "latin1_key": ("Authorization: Bearer \xff\xfe\xe9\r\n", {403}),
        "nul_in_key": ("X-API-Key: a\x00b\r\n", {400, 403}),
        "x_api_key_right": (f"X-API-Key: {LIVE_KEY}\r\n", {200}),
        "bearer_right_padded": (f"Authorization: Bearer   {LIVE_KEY}  \r\n", {200}),
        "lowercase_scheme": (f"authorization: bearer {LIVE_KEY}\r\n", {200}),
    }
    for name, (hdr, allowed) in auth_cases.items():
        path = "/v1/admin/reload" + (f"?api_key={LIVE_KEY}&key={LIVE_KEY}" if name == "key_in_query_only" else "")
        req = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{hdr}Content-Length: 0\r\nConnection: close\r\n\r\n"
        st, b = _raw_request(port, req.encode("latin-1"))
        rows.append({"input": f"admin:{name}", "status": st})
        assert st in allowed, (name, st, b[:200])
    # wrong methods and unknown routes
    for method, path in (("DELETE", "/v1/search"), ("PUT", "/v1/admin/reload"), ("GET", "/v1/admin/reload"),
                         ("TRACE", "/"), ("GET", "/v2/search"), ("GET", "/v1/videos/0/file/extra")):
        st, b = _raw_request(port, f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
        rows.append({"input": f"{method} {path}", "status": st})
        assert st in (404, 405), (method, path, st)
    # the server is still healthy and serving
    assert httpx.post(srv.base_url + "/v1/search", json={"query": "ok", "k": 1}, timeout=30).status_code == 200
    assert verify_index(idx) == []
    assert not [r for r in rows if r["status"] >= 500 or r["status"] < 0], rows


def test_search_with_required_key_and_media_tokens(fuzz_index):
    """require_key_for_search: search and media need a key or a signed, unexpired, id-bound media token."""
    from gare_serve.app import create_app

    app = create_app(svc_settings(fuzz_index, api_keys=KEY, require_key_for_search=True))

    async def go():
        async with running_app(app) as c:
            assert (await c.post("/v1/search", json={"query": "x"})).status_code == 401
            assert (await c.post("/v1/search", json={"query": "x"}, headers={"X-API-Key": "nope"})).status_code == 403
            r = await c.post("/v1/search", json={"query": "x", "k": 2}, headers={"X-API-Key": KEY})
            assert r.status_code == 200
            hit = r.json()["results"][0]
            other = r.json()["results"][1]["id"]
            assert (await c.get(hit["video_url"])).status_code == 200
            token = hit["video_url"].split("token=")[1]
            exp, mac = token.split(".")
            forged = [f"/v1/videos/{other}/file?token={token}",  # another id
                      f"/v1/videos/{hit['id']}/file?token={int(exp) + 10}.{mac}",  # extended expiry
                      f"/v1/videos/{hit['id']}/file?token=1.{mac}",  # expired
                      f"/v1/videos/{hit['id']}/file?token={exp}.{'0' * 32}",
                      f"/v1/videos/{hit['id']}/file?token=", f"/v1/videos/{hit['id']}/file?token=..",
                      f"/v1/videos/{hit['id']}/thumbnail?token={exp}"]
            for url in forged:
                assert (await c.get(url)).status_code in (401, 403), url
    asyncio.run(go())


# ============================================================================================ pickles
class _Payload:
    """Unpickling this runs `touch MARKER` (what an attacker would put in a .npy or a checkpoint)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _pickle_npy(path: Path, marker: Path) -> None:
    arr = np.empty(3, dtype=object)
    arr[:] = [_Payload(marker), 1, 2]
    with open(path, "wb") as fh:
        np.save(fh, arr, allow_pickle=True)


def _rehash_manifest(vdir: Path, fname: str) -> None:
    """Make the manifest agree with the replaced file (size and sha256): only the loader stands in the way."""
    m = json.loads((vdir / "manifest.json").read_text())
    data = (vdir / fname).read_bytes()
    m["files"][fname] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (vdir / "manifest.json").write_text(json.dumps(m, indent=1, sort_keys=True))
    reseal(vdir)


def test_pickle_payloads_in_index_files_never_run(robust_env, tmp_path, figure):
    from gare_serve.app import create_app

    marker = tmp_path / "PWNED"
    fig = figure("pickle_index", rows=[], marker_appeared=None)
    # the payload works: loading it with pickle allowed would run it
    probe = tmp_path / "probe.npy"
    _pickle_npy(probe, tmp_path / "probe-marker")
    np.load(probe, allow_pickle=True)
    assert (tmp_path / "probe-marker").exists()

    rows = fig["rows"]
    cases = [("ids.npy", "pickle", True), ("frames.npy", "pickle", True), ("norms.npy", "pickle", True),
             ("biases.npy", "pickle", False), ("ann.faiss", "junk", True), ("ann.faiss", "pickle", True),
             ("meta.sqlite", "pickle", True)]
    for fname, kind, rehash in cases:
        idx = copy_index(robust_env, tmp_path / f"idx-{fname}-{kind}-{rehash}")
        vdir = idx / "versions" / (idx / "CURRENT").read_text().strip()
        target = vdir / fname
        if kind == "pickle" and fname.endswith(".npy"):
            _pickle_npy(target, marker)
        elif kind == "pickle":
            import pickle

            target.write_bytes(pickle.dumps(_Payload(marker)))
        else:
            target.write_bytes(np.random.default_rng(0).bytes(target.stat().st_size))
        if rehash:
            _rehash_manifest(vdir, fname)
        outcome = {"file": fname, "kind": kind, "manifest_rehashed": rehash}
        rows.append(outcome)
        try:
            open_index(idx, verify=True).close()
            outcome["open_refused"] = False
        except IndexFormatError:
            outcome["open_refused"] = True
        assert outcome["open_refused"], outcome
        rc, out, err = index_cli("verify", "--out", str(idx))
        assert rc == 1, (fname, out, err)
        outcome["verify_rc"] = rc
        rc, out, err = index_cli("add", "--videos", str(robust_env["base_lib"]), "--out", str(idx), "--workers", "0",
                                 "--no-progress")
        outcome["add_rc"] = rc
        assert rc == 1 and "Traceback" not in err, (fname, rc, err)  # refused with a message
        # the service refuses to start on it (with or without re-hashing), and the marker never appears
        for rehash_on_open in (False, True):
            app = create_app(svc_settings(idx, verify_index=rehash_on_open))
            started = True

            async def go(app=app):
                async with running_app(app) as c:
                    return (await c.post("/v1/search", json={"query": "x", "k": 2})).status_code

            try:
                status = asyncio.run(go())
            except Exception:  # noqa: BLE001 - StartupError from the lifespan
                started, status = False, None
            outcome[f"serve_verify_{rehash_on_open}"] = "refused to start" if not started else f"started, search {status}"
            assert not started, outcome
            assert not marker.exists()
        fig["marker_appeared"] = marker.exists()
        assert not marker.exists(), outcome
    fig["marker_appeared"] = marker.exists()
    assert not marker.exists()


# Fixed (found by this suite): the service's reload (and startup) accepted a version whose meta.sqlite is not a database when the
# file has the size the manifest says (bit rot, or a copy error) and verify_index is off (the default):
# open_index never opens SQLite, so the reload answers 200 and then every search returns 500 ("internal
# server error") until an operator notices. Fix: open the DB and run a cheap query (e.g. `SELECT count(*)
# FROM videos` == n, or `PRAGMA quick_check`) in open_version, raising IndexFormatError.
def test_reload_refuses_a_junk_sqlite_of_the_right_size(robust_env, tmp_path):
    from gare_build.build import recompute_biases
    from gare_serve.app import create_app

    idx = copy_index(robust_env, tmp_path / "index")
    app = create_app(svc_settings(idx, api_keys=KEY))

    async def go():
        async with running_app(app) as c:
            name = recompute_biases(str(idx)).version
            target = idx / "versions" / name / "meta.sqlite"
            junk = np.random.default_rng(1).bytes(target.stat().st_size)
            tmp = target.with_name("junk")
            tmp.write_bytes(junk)
            os.replace(tmp, target)  # a new inode: the previous version's hard link keeps the good file
            r = await c.post("/v1/admin/reload", headers={"Authorization": f"Bearer {KEY}"})
            s = await c.post("/v1/search", json={"query": "a red circle", "k": 3})
            return r.status_code, s.status_code

    reload_status, search_status = asyncio.run(go())
    assert search_status == 200 and reload_status != 200, (reload_status, search_status)


def test_pickle_checkpoints_never_run(robust_env, tmp_path, figure):
    import torch

    from gare.checkpoint import CheckpointError, load_model, read_checkpoint
    from gare_serve.app import create_app
    from gare_serve.engine.startup import StartupError, resolve_checkpoint

    marker = tmp_path / "PWNED"
    evil = tmp_path / "evil.safetensors"
    torch.save({"model": _Payload(marker), "w": torch.zeros(2)}, evil)
    # a safetensors header claiming an absurd length, and one that is valid JSON but not a GARE checkpoint
    huge = tmp_path / "huge-header.safetensors"
    huge.write_bytes(struct.pack("<Q", 1 << 62) + b"{}")
    from safetensors.torch import save_file

    plain = tmp_path / "plain.safetensors"
    save_file({"x": torch.zeros(2)}, str(plain))
    fig = figure("pickle_checkpoint", rows=[], marker_appeared=None)
    rows = fig["rows"]
    for ck in (evil, huge, plain):
        with pytest.raises((CheckpointError, OSError, ValueError)):
            load_model(ck, "cpu")
        with pytest.raises((CheckpointError, OSError, ValueError)):
            read_checkpoint(ck)
        rc, out, err = index_cli("build", "--checkpoint", str(ck), "--videos", str(robust_env["base_lib"]),
                                 "--out", str(tmp_path / f"idx-{ck.stem}"), "--workers", "0", "--no-progress")
        assert rc == 1 and "Traceback" not in err, (rc, err)
        # a service pointed at it (the index manifest names it, sha256 included) refuses to start
        idx = copy_index(robust_env, tmp_path / f"served-{ck.stem}")
        vdir = idx / "versions" / (idx / "CURRENT").read_text().strip()
        m = json.loads((vdir / "manifest.json").read_text())
        m["checkpoint"]["path"] = str(ck)
        m["checkpoint"]["sha256"] = hashlib.sha256(ck.read_bytes()).hexdigest()
        (vdir / "manifest.json").write_text(json.dumps(m))
        reseal(vdir)
        resolve_checkpoint(svc_settings(idx))  # the hash matches: only the loader stands in the way
        app = create_app(svc_settings(idx))
        with pytest.raises(StartupError, match="cannot load checkpoint"):
            asyncio.run(_start(app))
        from gare_serve.cli import main as serve_main

        check_rc = serve_main(["--index", str(idx), "--check"])
        rows.append({"checkpoint": ck.name, "load_refused": True, "index_build_rc": rc, "serve_refused": True,
                     "serve_check_rc": check_rc})
        assert check_rc == 2, rows[-1]  # --check loads the checkpoint: refused like the real start
        assert not marker.exists()
    # the official-checkpoint importer reads with weights_only=True
    from gare_train.authors_checkpoint import load_official_state_dict

    bin_path = tmp_path / "pytorch_model.bin.4"
    torch.save({"state": _Payload(marker)}, bin_path)
    with pytest.raises(Exception):  # noqa: B017 - any refusal will do, as long as nothing runs
        load_official_state_dict(bin_path)
    rows.append({"checkpoint": bin_path.name, "load_refused": True})
    fig["marker_appeared"] = marker.exists()
    assert not marker.exists()


async def _start(app):
    async with running_app(app):
        pass


# ============================================================================================ videos
def _avi_with_dims(src_avi: Path, dst: Path, w: int, h: int) -> Path:
    d = bytearray(src_avi.read_bytes())
    a = d.find(b"avih")
    d[a + 8 + 32 : a + 8 + 40] = struct.pack("<II", w, h)
    s = d.find(b"strf")
    d[s + 8 + 4 : s + 8 + 12] = struct.pack("<ii", w, h)
    dst.write_bytes(bytes(d))
    return dst


def _tiny_rawvideo_avi(path: Path) -> Path:
    import av

    with av.open(str(path), "w") as out:
        s = out.add_stream("rawvideo", rate=8)
        s.width, s.height, s.pix_fmt = 16, 16, "rgb24"
        for _ in range(4):
            fr = av.VideoFrame.from_ndarray(np.zeros((16, 16, 3), np.uint8), format="rgb24")
            for pkt in s.encode(fr):
                out.mux(pkt)
        for pkt in s.encode():
            out.mux(pkt)
    return path


def test_hostile_video_files_are_reported_and_skipped(robust_env, tmp_path, monkeypatch, figure):
    import gare.video as V
    from gare_train.synth import write_video
    from tests.badfiles import write_bad_videos

    lib = copy_lib(robust_env, tmp_path / "lib", ["video0.mp4", "video1.mp4", "video2.mp4"])
    bad = write_bad_videos(lib / "bad")  # empty, truncated, random, no_moov, wrong_container (PNG), text
    hostile = {f"bad/{k}.mp4" for k in bad}
    raw = _tiny_rawvideo_avi(tmp_path / "raw.avi")
    _avi_with_dims(raw, lib / "claims_20000x20000.avi", 20000, 20000)  # FFmpeg refuses the size
    _avi_with_dims(raw, lib / "claims_9000x9000.avi", 9000, 9000)  # over gare.video.MAX_FRAME_PIXELS
    hostile |= {"claims_20000x20000.avi", "claims_9000x9000.avi"}
    # a real 64x64 video, "huge" once MAX_FRAME_PIXELS is lowered (the limit is read at decode time)
    write_video(lib / "big_64x64.mp4", np.random.default_rng(0).integers(0, 255, (8, 64, 64, 3), dtype=np.uint8), 8.0)
    monkeypatch.setattr(V, "MAX_FRAME_PIXELS", 40 * 40)
    hostile.add("big_64x64.mp4")
    (lib / "zero.mkv").write_bytes(b"")
    (lib / "dir.mp4").mkdir()
    os.symlink("/dev/zero", lib / "devzero.mp4")  # never read: it would never end
    os.symlink("/dev/urandom", lib / "urandom.webm")
    os.symlink("loop2.mp4", lib / "loop1.mp4")  # a symlink loop
    os.symlink("loop1.mp4", lib / "loop2.mp4")
    os.mkfifo(lib / "pipe.mp4")  # not a regular file (and never opened: reading a FIFO would block)
    os.symlink(lib / "does-not-exist.mp4", lib / "dangling.mkv")  # vanished target
    (lib / "notes.txt").write_text("not a video")  # ignored (not a video type), not an error
    (lib / ".partial.mp4").write_bytes(b"")  # hidden files are not looked at
    hostile |= {"pipe.mp4", "dangling.mkv"}
    shutil.copy2(lib / "bad" / "random.mp4", lib / "name with\nnewline ‮4pm.exe.mp4")
    hostile |= {"zero.mkv", "devzero.mp4", "urandom.webm", "loop1.mp4", "loop2.mp4", "name with\nnewline ‮4pm.exe.mp4"}
    idx = tmp_path / "index"
    sw = Stopwatch()
    fig = figure("hostile_videos", files=sorted(hostile))
    rc, out, err = index_cli("build", "--checkpoint", str(robust_env["checkpoint"]), "--videos", str(lib),
                             "--out", str(idx), "--workers", "0", "--no-progress", "--decode-timeout", "60")
    fig["exit_code"] = rc
    report = json.loads((idx / "report.json").read_text())
    reasons = {os.path.relpath(s["path"], lib): s["reason"] for s in report["skipped"]}
    fig["reasons"] = reasons
    fig["skipped_hostile"] = sorted(set(reasons) & hostile)
    assert rc == 3, (out, err)
    assert "skipped" in out and "report.json" in out  # the summary line
    assert report["exit_code"] == 3 and report["status"] == "done with skipped files"
    assert [os.path.basename(x["path"]) for x in report["ignored"]] == ["notes.txt"]
    assert reasons["pipe.mp4"] == "not a regular file" and "not found" in reasons["dangling.mkv"]
    assert reasons["bad/empty.mp4"] == "empty file" and "not a video container" in reasons["bad/wrong_container.mp4"]
    assert ".partial.mp4" not in reasons
    for name in hostile - {"name with\nnewline \u202e4pm.exe.mp4"}:
        assert os.path.basename(name) in err  # each skip is also printed with its reason
    missing = hostile - set(reasons)
    # a directory named dir.mp4 is not a file: skipped or ignored, never indexed
    assert not missing, (missing, reasons)
    assert all(reasons.values())
    assert "frame too large" in reasons["claims_9000x9000.avi"] and "frame too large" in reasons["big_64x64.mp4"]
    v = open_index(idx, verify=True)
    try:
        fig["indexed"] = sorted(os.path.basename(r["path"]) for r in v.all_metadata())
    finally:
        v.close()
    fig["verify_problems"] = verify_index(idx)
    fig["seconds"] = sw.s
    assert fig["indexed"] == ["video0.mp4", "video1.mp4", "video2.mp4"]
    assert fig["verify_problems"] == []


# Manifests (JSONL / CSV) with bad rows, a library with nothing indexable, bad arguments: skipped with a reason or
# refused naming the bad value; the exit codes are documented in --help.
def test_bad_manifest_rows(robust_env, tmp_path):
    ckpt = robust_env["checkpoint"]
    lib = copy_lib(robust_env, tmp_path / "lib", ["video0.mp4", "video1.mp4", "video2.mp4"])
    (lib / "clip.txt").write_text("x")
    rows = [
        {"video": "lib/video0.mp4", "id": 100},
        {"video": "lib/video1.mp4", "id": 100},  # duplicate id
        {"video": "lib/video2.mp4", "id": 7, "start": 0.0, "end": 1.0},
        {"video": "lib/video2.mp4", "id": 8, "start": 0.0, "end": 1.0},  # same file and window again
        {"video": "lib/video2.mp4", "start": 1.0},  # a second window of video2, auto id
        {"video": "lib/vanished.mp4"},  # listed but gone
        {"video": "lib/clip.txt"},  # unsupported type
        {"video": "lib/video1.mp4", "start": "soon"},  # bad value
        {"video": "lib/video1.mp4", "id": -3},
        {"nothing": 1},
    ]
    manifest = tmp_path / "videos.jsonl"
    manifest.write_text("\n".join(json.dumps(r) for r in rows) + "\nnot json\n")
    out = tmp_path / "INDEX"
    rc = index_main(["build", "--checkpoint", str(ckpt), "--videos", str(manifest), "--out", str(out), "--workers", "0",
               "--no-progress"])
    assert rc == 3
    report = json.loads((out / "report.json").read_text())
    reasons = [s["reason"] for s in report["skipped"]]
    joined = "\n".join(reasons)
    assert "duplicate id 100" in joined and "duplicate entry" in joined and "file not found" in joined
    assert "unsupported file type '.txt'" in joined and "invalid start 'soon'" in joined and "invalid id -3" in joined
    assert "no 'video' path" in joined and "invalid JSON" in joined
    assert len(reasons) == 8
    v = open_index(out)
    md = {r["id"]: r for r in v.all_metadata()}
    assert set(md) == {100, 7, 101}
    assert (md[7]["start"], md[7]["end"]) == (0.0, 1.0) and md[101]["start"] == 1.0 and md[101]["end"] is None
    assert verify_index(out) == []

    # CSV manifests work the same way
    csv_path = tmp_path / "videos.csv"
    csv_path.write_text("video,start,end,id\nlib/video0.mp4,,,5\nlib/video1.mp4,0.5,1.5,\n")
    out2 = tmp_path / "INDEX2"
    assert index_main(["build", "--checkpoint", str(ckpt), "--videos", str(csv_path), "--out", str(out2), "--workers", "0",
                 "--no-progress"]) == 0
    md2 = {r["id"]: r for r in open_index(out2).all_metadata()}
    assert set(md2) == {5, 6} and (md2[6]["start"], md2[6]["end"]) == (0.5, 1.5)


def test_nothing_indexable_fails_without_a_version(robust_env, tmp_path, capsys):
    ckpt = robust_env["checkpoint"]
    write_bad_videos(tmp_path / "bad")
    out = tmp_path / "INDEX"
    rc = index_main(["build", "--checkpoint", str(ckpt), "--videos", str(tmp_path / "bad"), "--out", str(out),
               "--workers", "0", "--no-progress"])
    assert rc == 1
    assert "nothing could be indexed" in capsys.readouterr().err
    assert list_versions(out) == [] and not (out / "CURRENT").exists()
    assert json.loads((out / "report.json").read_text())["exit_code"] == 1


@pytest.mark.parametrize("argv, message", [
    (["build", "--checkpoint", "/nope.safetensors", "--videos", ".", "--out", "X"], "/nope.safetensors"),
    (["build", "--checkpoint", "CK", "--videos", "/no/such/dir", "--out", "X"], "/no/such/dir"),
])
def test_errors_name_the_bad_value(robust_env, tmp_path, argv, message, capsys):
    ckpt = robust_env["checkpoint"]
    argv = [str(ckpt) if a == "CK" else str(tmp_path / "X") if a == "X" else a for a in argv]
    assert index_main(argv + ["--no-progress"]) == 1
    assert message in capsys.readouterr().err


def test_help_documents_exit_codes(capsys):
    for argv in (["--help"], ["build", "--help"]):
        with pytest.raises(SystemExit) as ei:
            index_main(argv)
        assert ei.value.code == 0
        text = capsys.readouterr().out
        assert "exit codes" in text and "3  done, but some files were skipped" in text and "1  failed" in text
    with pytest.raises(SystemExit) as ei:
        index_main(["build", "--checkpoint", "x", "--videos", "y", "--out", "z", "--segment", "-1"])
    assert ei.value.code == 2
    assert "-1" in capsys.readouterr().err


# ============================================================================================ known bugs
# Fixed (found by this suite): gare_serve/engine/prometheus.py labels gare_http_requests_total by the raw HTTP method (scope["method"]); a client
# can send any token as a method (every one gets a 405), so each new method adds a label set that lives
# forever: unbounded memory and /metrics size (the module docstring promises a bounded label set).
# Reproduce: for i in $(seq 1000); do curl -s -X M$i http://127.0.0.1:8000/healthz; done; curl .../metrics
# Fix: label unknown methods as "other" (keep GET/HEAD/POST/PUT/DELETE/PATCH/OPTIONS/TRACE/CONNECT).
def test_metrics_labels_stay_bounded_under_random_methods(fuzz_index):
    from gare_serve.app import create_app

    app = create_app(svc_settings(fuzz_index))

    async def go():
        async with running_app(app) as c:
            for i in range(200):
                await c.request(f"M{i:04d}", "/healthz")
            return (await c.get("/metrics")).text

    text = asyncio.run(go())
    methods = {line.split('method="')[1].split('"')[0] for line in text.splitlines()
               if line.startswith("gare_http_requests_total{") and 'method="' in line}
    assert len(methods) <= 10, f"{len(methods)} method labels, e.g. {sorted(methods)[:5]}"


# Fixed (found by this suite): the service answered 400 {"detail": "There was an error parsing the body"} (FastAPI's default) to a
# body that is not UTF-8, nested too deeply or holds an integer over Python's 4300-digit limit, and the
# middleware answers 400 to an invalid Content-Length; no route's OpenAPI responses list 400, so clients
# generated from /openapi.json see an undocumented status (schemathesis: "ST103 Undocumented status code").
# Reproduce: curl -X POST localhost:8000/v1/search -H 'content-type: application/json' --data-binary $'\xff'
# Fix: add 400 to ERRORS (or map body-decoding errors to the documented 422).
def test_status_for_undecodable_bodies_is_documented(fuzz_index):
    from gare_serve.app import create_app

    app = create_app(svc_settings(fuzz_index))

    async def go():
        async with running_app(app) as c:
            doc = (await c.get("/openapi.json")).json()
            r = await c.post("/v1/search", content=b'{"query": "\xff"}', headers={"content-type": "application/json"})
            return doc, r.status_code

    doc, status = asyncio.run(go())
    assert str(status) in doc["paths"]["/v1/search"]["post"]["responses"], status


# Fixed (found by this suite): the service's require_media() declares `video_id: int` without bounds, and FastAPI publishes that
# declaration for /v1/videos/{video_id}/thumbnail and /file: the OpenAPI document says any integer while the
# route (VideoId) refuses negative ids with 422 (schemathesis' positive cases get 422 from documented-valid
# input). Fix: annotate require_media's video_id with the same VideoId type.
def test_openapi_states_the_id_bounds_of_media_routes(fuzz_index):
    from gare_serve.app import create_app

    doc = create_app(svc_settings(fuzz_index)).openapi()
    for route in ("/v1/videos/{video_id}/thumbnail", "/v1/videos/{video_id}/file"):
        (param,) = [p for p in doc["paths"][route]["get"]["parameters"] if p["name"] == "video_id"]
        assert param["schema"].get("minimum") == 0, (route, param)


# Fixed (found by this suite): GET /v1/index depends on require_search (401/403 when require_key_for_search is on) but
# is declared without `responses=ERRORS`: its OpenAPI document lists only 200 (schemathesis ST103 on 401).
# Fix: add responses=ERRORS (or {401, 403}) to the route decorator.
def test_index_route_documents_its_auth_errors(fuzz_index):
    from gare_serve.app import create_app

    app = create_app(svc_settings(fuzz_index, api_keys=KEY, require_key_for_search=True))

    async def go():
        async with running_app(app) as c:
            doc = (await c.get("/openapi.json")).json()
            return doc, (await c.get("/v1/index")).status_code

    doc, status = asyncio.run(go())
    assert status == 401
    assert "401" in doc["paths"]["/v1/index"]["get"]["responses"]


# Fixed (found by this suite): gare_serve/cli.py `gare-serve --check` ("verify settings, checkpoint hash and index, then exit") never
# opens the index version nor loads the checkpoint: it prints "ok" and exits 0 for an index whose
# frames.npy is truncated and for a checkpoint that is not loadable (a pickle renamed .safetensors), both of
# which make the real start fail. Reproduce: truncate INDEX/versions/v000001/frames.npy, then
# `gare-serve --index INDEX --check; echo $?` -> "ok: ..." 0. Fix: open_index(...) and load_model(...) in --check.
def test_serve_check_opens_the_index(robust_env, tmp_path):
    from gare_serve.cli import main as serve_main

    idx = copy_index(robust_env, tmp_path / "index")
    vdir = idx / "versions" / (idx / "CURRENT").read_text().strip()
    data = (vdir / "frames.npy").read_bytes()
    (vdir / "frames.npy").write_bytes(data[: len(data) // 2])
    assert verify_index(idx) != []
    assert serve_main(["--index", str(idx), "--check"]) == 2
