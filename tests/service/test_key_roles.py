"""Key roles through the app over HTTP (httpx in process, the lifespan running): search keys, admin keys and the
deprecated api keys (admin keys, with one start-up WARNING naming the new settings), on every admin route (found by
walking the app's routes: prefix, tag and dependency must agree), the search routes and /metrics; keys held only
as sha256 digests."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re

import pytest
from fastapi.routing import APIRoute, RouteContext, iter_route_contexts

from gare_serve.app import create_app
from gare_serve.settings import KeyRoles, load_key_roles
from gare_serve.web.admin_routes import ADMIN_PREFIX, ADMIN_TAG
from gare_serve.web.deps import require_admin, require_media, require_search
from tests.service.support import running_app, settings

SEARCH_KEY = "search-key-roles-1"
ADMIN_KEY = "admin-key-roles-2"
LEGACY_KEY = "legacy-api-key-3"
ALL_KEYS = (SEARCH_KEY, ADMIN_KEY, LEGACY_KEY)


def _depends_on(dependant, fn) -> bool:
    return any(d.call is fn or _depends_on(d, fn) for d in dependant.dependencies)


def api_routes(app) -> list[RouteContext]:
    """The app's FastAPI routes as they are served: paths with their router's prefix, tags and dependencies with
    their router's (FastAPI keeps included routers unflattened in app.routes)."""
    return [r for r in iter_route_contexts(app.routes) if isinstance(r.original_route, APIRoute)]


def admin_routes(app) -> list[RouteContext]:
    """Every admin route of the app, by each of the three marks; they must agree (a route with one mark and not
    the others is a route someone added beside the admin router)."""
    routes = api_routes(app)
    by_path = {r.path for r in routes if r.path.startswith(ADMIN_PREFIX + "/")}
    by_tag = {r.path for r in routes if ADMIN_TAG in r.tags}
    by_dep = {r.path for r in routes if _depends_on(r.dependant, require_admin)}
    assert by_path == by_tag == by_dep, (by_path, by_tag, by_dep)
    # nothing else (a mount, a plain Starlette route) answers under the admin prefix
    others = [r.path or "" for r in iter_route_contexts(app.routes) if not isinstance(r.original_route, APIRoute)]
    assert not [p for p in others if p.startswith(ADMIN_PREFIX)], others
    out = [r for r in routes if r.path in by_path]
    assert out, "no admin route found"
    return out


def search_routes(app) -> list[RouteContext]:
    """The routes a search key opens: those needing require_search or require_media (and no admin key)."""
    return [r for r in api_routes(app)
            if (_depends_on(r.dependant, require_search) or _depends_on(r.dependant, require_media))
            and not _depends_on(r.dependant, require_admin)]


def concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "0", path)  # every path parameter here is an id: 0 exists in the test index


def auth(key: str | None) -> dict[str, str]:
    return {} if key is None else {"Authorization": f"Bearer {key}"}


async def call(client, route: RouteContext, key: str | None):
    out = {}
    for method in sorted(route.methods - {"HEAD"}):
        out[method] = await client.request(method, concrete(route.path), headers=auth(key))
    return out


async def role_matrix(client, app, *, search_needs_key: bool, metrics_need_key: bool) -> dict:
    """Status and detail of every (key, route) pair the tests check: no key, search, admin, legacy, a wrong key."""
    keys = {"none": None, "search": SEARCH_KEY, "admin": ADMIN_KEY, "legacy": LEGACY_KEY, "wrong": "not-a-key"}
    got: dict = {"admin": {}, "search": {}, "metrics": {}, "search_post": {}}
    for name, key in keys.items():
        for r in admin_routes(app):
            for method, resp in (await call(client, r, key)).items():
                got["admin"][(name, method, r.path)] = (resp.status_code, resp.json().get("detail"))
        for r in search_routes(app):
            for method, resp in (await call(client, r, key)).items():
                got["search"][(name, method, r.path)] = resp.status_code
        resp = await client.post("/v1/search", json={"query": "a dog", "k": 2}, headers=auth(key))
        got["search_post"][name] = resp.status_code
        got["metrics"][name] = (await client.get("/metrics", headers=auth(key))).status_code
    # what each role must get
    for (name, method, path), (status, detail) in got["admin"].items():
        where = f"{name} key, {method} {path}: {status} {detail}"
        if name == "none":
            assert status == 401, where
        elif name == "search":
            assert status == 403 and "admin key" in detail and "search key" in detail, where
            assert SEARCH_KEY not in detail and hashlib.sha256(SEARCH_KEY.encode()).hexdigest() not in detail, where
        elif name == "wrong":
            assert status == 403 and detail == "invalid API key", where
        else:
            assert status not in (401, 403), where
    for (name, method, path), status in got["search"].items():
        where = f"{name} key, {method} {path}: {status}"
        if name in ("search", "admin", "legacy") or not search_needs_key:
            assert status not in (401, 403), where
        else:
            assert status == (401 if name == "none" else 403), where
    for name, status in got["search_post"].items():
        refused = search_needs_key and name in ("none", "wrong")
        assert status == ({"none": 401, "wrong": 403}[name] if refused else 200), (name, status)
    for name, status in got["metrics"].items():
        refused = metrics_need_key and name in ("none", "wrong")
        assert status == ({"none": 401, "wrong": 403}[name] if refused else 200), (name, status)
    return got


def role_settings(index, **kw):
    return settings(index, search_keys=SEARCH_KEY, admin_keys=ADMIN_KEY, api_keys=LEGACY_KEY, **kw)


@pytest.mark.parametrize("search_needs_key,metrics_need_key", [(True, True), (False, False), (False, True)])
def test_role_matrix(service_env, search_needs_key, metrics_need_key):
    s = role_settings(service_env["index"], require_key_for_search=search_needs_key, media_secret="m" * 40,
                      metrics_require_key=metrics_need_key)
    app = create_app(s)

    async def go():
        async with running_app(app) as client:
            return await role_matrix(client, app, search_needs_key=search_needs_key, metrics_need_key=metrics_need_key)

    got = asyncio.run(go())
    # the admin route really ran for the admin and legacy keys (reload of an unchanged index: 200, not reloaded)
    assert got["admin"][("admin", "POST", ADMIN_PREFIX + "/reload")] == (200, None)
    assert got["admin"][("legacy", "POST", ADMIN_PREFIX + "/reload")] == (200, None)
    assert len(got["search"]) >= 5 * 4  # search, batch, image, index, videos and media routes were all walked


def test_a_search_key_never_opens_an_admin_route_when_only_search_keys_exist(service_env):
    """No admin key configured: the admin API is closed (403 naming the setting), even to a search key."""
    app = create_app(settings(service_env["index"], search_keys=SEARCH_KEY, require_key_for_search=True,
                              media_secret="m" * 40))

    async def go():
        async with running_app(app) as client:
            return ([await client.post(concrete(r.path), headers=auth(SEARCH_KEY)) for r in admin_routes(app)],
                    await client.post("/v1/search", json={"query": "a dog", "k": 2}, headers=auth(SEARCH_KEY)))

    admin, search = asyncio.run(go())
    for r in admin:
        assert r.status_code == 403 and "GARE_ADMIN_KEYS" in r.json()["detail"], r.text
    assert search.status_code == 200, search.text


def test_keys_files_give_roles(service_env, tmp_path):
    sf, af = tmp_path / "search.txt", tmp_path / "admin.txt"
    sf.write_text(f"# search clients\n{SEARCH_KEY}\n\nsha256:{hashlib.sha256(b'hashed-search').hexdigest()}\n")
    af.write_text(f"{ADMIN_KEY}\n")
    s = settings(service_env["index"], search_keys_file=sf, admin_keys_file=af, require_key_for_search=True,
                 media_secret="m" * 40)
    roles = load_key_roles(s)
    assert roles == KeyRoles(
        search=tuple(sorted([hashlib.sha256(SEARCH_KEY.encode()).hexdigest(), hashlib.sha256(b"hashed-search").hexdigest()])),
        admin=(hashlib.sha256(ADMIN_KEY.encode()).hexdigest(),), legacy=0)
    app = create_app(s)

    async def go():
        async with running_app(app) as client:
            return {k: (await client.post("/v1/admin/reload", headers=auth(k)),
                        await client.post("/v1/search", json={"query": "a dog", "k": 2}, headers=auth(k)))
                    for k in (SEARCH_KEY, "hashed-search", ADMIN_KEY)}

    got = asyncio.run(go())
    for k in (SEARCH_KEY, "hashed-search"):
        assert got[k][0].status_code == 403 and got[k][1].status_code == 200, k
    assert got[ADMIN_KEY][0].status_code == 200 and got[ADMIN_KEY][1].status_code == 200
    with pytest.raises(Exception, match="cannot read the search keys file"):
        create_app(settings(service_env["index"], search_keys_file=tmp_path / "missing.txt"))


def test_a_key_listed_under_both_roles_is_an_admin_key():
    s = settings(".", search_keys=f"{ADMIN_KEY},{SEARCH_KEY}", admin_keys=ADMIN_KEY)
    roles = load_key_roles(s)
    assert roles.admin == (hashlib.sha256(ADMIN_KEY.encode()).hexdigest(),)
    assert roles.search == (hashlib.sha256(SEARCH_KEY.encode()).hexdigest(),)


def test_keys_are_held_only_as_digests(service_env, monkeypatch):
    """Neither the settings (repr, dump: the workers' environment is built from it), nor the app's or the running
    state's key table hold a key in clear; the same digests come back from the environment variables."""
    s = role_settings(service_env["index"])
    dump = repr(s) + repr(s.model_dump()) + s.model_dump_json()
    app = create_app(s)

    async def go():
        async with running_app(app) as client:
            assert (await client.post("/v1/admin/reload", headers=auth(ADMIN_KEY))).status_code == 200
            return repr(app.state.keys) + repr(vars(app.state.gare.keys)) + repr(app.state.gare.settings.model_dump())

    held = dump + asyncio.run(go())
    # keys given to create_app beside a Settings object (a copy, which skips the validators) are hashed too
    held += repr(create_app(settings(service_env["index"]), admin_keys=ADMIN_KEY).state.settings.model_dump())
    for key in ALL_KEYS:
        assert key not in held
        assert hashlib.sha256(key.encode()).hexdigest() in held  # the digests are there instead
    assert s.admin_keys == "sha256:" + hashlib.sha256(ADMIN_KEY.encode()).hexdigest()
    # the environment, and a settings copy re-read from a dump (a worker of gare-serve --workers), give the same roles
    for name, key in (("GARE_SEARCH_KEYS", SEARCH_KEY), ("GARE_ADMIN_KEYS", ADMIN_KEY), ("GARE_API_KEYS", LEGACY_KEY)):
        monkeypatch.setenv(name, f" {key} , ")
    from gare_serve.settings import Settings

    from_env = Settings(index=service_env["index"])
    assert load_key_roles(from_env) == load_key_roles(s)
    for name in ("GARE_SEARCH_KEYS", "GARE_ADMIN_KEYS", "GARE_API_KEYS"):
        monkeypatch.delenv(name)
    # what gare-serve --workers hands its workers: the settings' dump as GARE_* variables, digests only
    from gare_serve.cli import worker_environment

    worker_env = worker_environment(s, 2, service_env["index"], service_env["index"])
    assert not [k for k in ALL_KEYS if k in repr(worker_env)]
    for name in ("GARE_SEARCH_KEYS", "GARE_ADMIN_KEYS", "GARE_API_KEYS"):
        monkeypatch.setenv(name, worker_env[name])
    assert load_key_roles(Settings(index=service_env["index"])) == load_key_roles(s)


def test_legacy_keys_warn_once_naming_the_new_settings(service_env, caplog, tmp_path):
    caplog.set_level(logging.WARNING, logger="gare_serve.app")

    def warnings():
        return [r for r in caplog.records if r.name == "gare_serve.app" and "GARE_API_KEYS" in r.getMessage()]

    create_app(settings(service_env["index"], search_keys=SEARCH_KEY, admin_keys=ADMIN_KEY))
    assert warnings() == []  # the new settings alone: no warning
    key = f"legacy-{tmp_path.name}"  # a configuration this process has not warned about
    s = settings(service_env["index"], api_keys=key)
    create_app(s)
    create_app(s.model_copy(update={"torch_threads": 1}))  # gare-serve builds its app twice: still one warning
    (w,) = warnings()
    msg = w.getMessage()
    assert w.levelno == logging.WARNING and "GARE_SEARCH_KEYS" in msg and "GARE_ADMIN_KEYS" in msg and "ADMIN" in msg
    assert key not in msg and hashlib.sha256(key.encode()).hexdigest() not in msg
    kf = tmp_path / "legacy.txt"
    kf.write_text(f"{key}-file\n")
    create_app(settings(service_env["index"], api_keys_file=kf))  # the deprecated file warns too
    assert len(warnings()) == 2
    # a worker of gare-serve --workers (run_dir set) leaves the warning to its parent
    create_app(settings(service_env["index"], api_keys=key + "-worker", run_dir=tmp_path))
    assert len(warnings()) == 2


def test_keys_from_a_config_file_and_the_command_line(tmp_path, monkeypatch):
    from gare_serve.cli import build_parser, settings_from_args
    from gare_serve.settings import load_settings

    for k in list(__import__("os").environ):
        if k.startswith("GARE_"):
            monkeypatch.delenv(k)
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"search_keys: [{SEARCH_KEY}, other-search]\nGARE_ADMIN_KEYS: {ADMIN_KEY}\n")
    s = load_settings(cfg)
    digest = {k: hashlib.sha256(k.encode()).hexdigest() for k in (SEARCH_KEY, "other-search", ADMIN_KEY)}
    assert load_key_roles(s) == KeyRoles(search=tuple(sorted([digest[SEARCH_KEY], digest["other-search"]])),
                                         admin=(digest[ADMIN_KEY],))
    assert SEARCH_KEY not in s.model_dump_json() and ADMIN_KEY not in s.model_dump_json()
    sf, af = tmp_path / "s.txt", tmp_path / "a.txt"
    sf.write_text("s1\n")
    af.write_text("a1\n")
    args = build_parser().parse_args(["--search-keys-file", str(sf), "--admin-keys-file", str(af)])
    roles = load_key_roles(settings_from_args(args))
    assert roles.search == (hashlib.sha256(b"s1").hexdigest(),) and roles.admin == (hashlib.sha256(b"a1").hexdigest(),)
