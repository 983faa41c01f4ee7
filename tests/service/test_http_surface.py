"""The HTTP surface a deployment exposes: HEAD, trusted hosts, the metrics key, /docs offline, error bodies."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from gare_serve.app import create_app
from gare_serve.settings import Settings
from gare_serve.web.middleware import TrustedHostMiddleware, public_detail
from tests.service.support import copy_index, settings

KEY = "surface-key"
LEAK = re.compile(r"0x[0-9a-fA-F]{6,}|/tmp/|/home/|/root/|/srv/|File \"|Traceback")


@pytest.fixture(scope="module")
def app_env(service_env, tmp_path_factory):
    idx = copy_index(service_env["index"], tmp_path_factory.mktemp("surface") / "index")
    return idx, service_env


@pytest.fixture(scope="module")
def client(app_env):
    idx, _ = app_env
    with TestClient(create_app(settings(idx, api_keys=KEY)), raise_server_exceptions=False) as c:
        yield c


def test_head_wherever_get_is_served(client, app_env):
    """HEAD answered 405 on /, media and metadata routes; now the GET's status and headers, no body."""
    for path in ("/", "/healthz", "/readyz", "/metrics", "/v1/index", "/v1/videos/0", "/v1/videos/0/thumbnail",
                 "/v1/videos/0/file", "/docs", "/openapi.json", "/static/app.js"):
        g, h = client.get(path), client.head(path)
        assert h.status_code == g.status_code == 200, (path, h.status_code, g.status_code)
        assert h.content == b"", path
        assert h.headers.get("content-type") == g.headers.get("content-type"), path
        if path.endswith("/file") or path.startswith("/static"):
            assert h.headers["content-length"] == g.headers["content-length"]
    assert client.head("/v1/videos/999999").status_code == 404
    assert client.head("/v1/search").status_code == 405  # POST-only stays POST-only


def test_openapi_lists_get_not_head(client):
    doc = client.get("/openapi.json").json()
    assert all("head" not in ops for ops in doc["paths"].values())
    ids = [op["operationId"] for ops in doc["paths"].values() for op in ops.values()]
    assert len(ids) == len(set(ids)) and all(i.endswith(("_get", "_post")) for i in ids)


@pytest.mark.parametrize("host,ok", [
    ("localhost", True), ("localhost:8000", True), ("LOCALHOST", True), ("127.0.0.1:8000", True),
    ("[::1]:8000", True), ("[::1]", True), ("evil.example", False), ("evil.example:8000", False),
    ("localhost.evil.example", False), ("", False), ("127.0.0.2", False),
])
def test_loopback_default_refuses_other_hosts(app_env, host, ok):
    """Bound to loopback with no key, the page was readable by any web page through DNS rebinding."""
    idx, _ = app_env
    s = Settings(index=idx, text_encoder="fp32", batch_max_wait_ms=1.0)  # the real defaults: host 127.0.0.1
    assert s.trusted_host_list() == ["localhost", "127.0.0.1", "::1", "[::1]"]
    app = create_app(s)
    with TestClient(app, base_url="http://localhost") as c:
        r = c.get("/healthz", headers={"host": host})
    assert (r.status_code == 200) is ok, (host, r.status_code)
    if not ok:
        assert r.status_code == 400 and "Host" in r.json()["detail"]


def test_trusted_hosts_setting():
    assert Settings(host="0.0.0.0").trusted_host_list() == ["*"]
    m = TrustedHostMiddleware(None, ["search.example.com", "*.corp.example"])
    assert m.accepts("search.example.com:443") and m.accepts("a.corp.example") and m.accepts("SEARCH.example.com.")
    assert not m.accepts("corp.example.evil") and not m.accepts("example.com") and not m.accepts("[::1]")


def test_metrics_need_a_key_when_search_does(app_env):
    idx, _ = app_env
    with TestClient(create_app(settings(idx, api_keys=KEY, require_key_for_search=True, media_secret="m" * 40))) as c:
        assert c.get("/metrics").status_code == 401
        assert c.get("/metrics", headers={"X-API-Key": "wrong"}).status_code == 403
        r = c.get("/metrics", headers={"X-API-Key": KEY})
        assert r.status_code == 200 and "gare_" in r.text
        assert c.get("/healthz").status_code == 200  # liveness stays open for orchestrators
    with TestClient(create_app(settings(idx, api_keys=KEY, require_key_for_search=True, media_secret="m" * 40,
                                        metrics_require_key=False))) as c:
        assert c.get("/metrics").status_code == 200  # an explicit opt-out (a private scrape network)
    with TestClient(create_app(settings(idx, api_keys=KEY))) as c:
        assert c.get("/metrics").status_code == 200  # keyless search: keyless metrics, as before


def test_docs_assets_are_local(client):
    r = client.get("/docs")
    assert r.status_code == 200
    srcs = re.findall(r'(?:src|href)="([^"]+)"', r.text)
    assert srcs and all(s.startswith("/") for s in srcs), srcs  # nothing from a CDN
    for s in srcs:
        assert client.get(s).status_code == 200, s
    assert "<script>" not in r.text  # inline scripts are blocked by the CSP; the start-up code is a file
    assert "script-src 'self'" in r.headers["content-security-policy"]


def test_public_detail_strips_addresses_paths_and_tracebacks():
    assert public_detail("cannot identify image file <_io.BytesIO object at 0x7f3a2b1c4d50>") == \
        "cannot identify image file <_io.BytesIO object at 0x…>"
    assert public_detail("no such file /srv/gare/index/versions/v000001/meta.sqlite") == "no such file <path>"
    assert public_detail('Traceback (most recent call last):\n  File "x.py"') == "internal server error"
    assert public_detail("send POST /v1/admin/reload") == "send POST /v1/admin/reload"


@hsettings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(["image/png", "IMAGE/PNG", "image/png; x=y", "image/jpeg", "text/plain", "image/gif"]),
       st.binary(max_size=300))
def test_error_bodies_never_leak(client, ctype, data):
    """Whatever an upload holds, a 4xx body carries no memory address, path or traceback (Pillow's text did)."""
    r = client.post("/v1/search/image", files={"image": ("x", data, ctype)})
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert not LEAK.search(r.text), r.text
