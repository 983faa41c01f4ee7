"""POST /v1/admin/reload on the sharded ingress (gare_serve.ray_serve.ingress_state.ShardedServiceState.reload_here): the newest
generation at once, unchanged when there is none, and a generation a shard cannot open refused with a 503 while the
old one stays served. Shards in this process (LocalShards), as in test_sharded_app.py."""

from __future__ import annotations

import asyncio
import shutil

from gare_index.shards import current_generation, write_generation
from tests.serve_ray.test_sharded_app import env, sharded_client  # noqa: F401  (env is a fixture)

ADMIN = {"X-API-Key": "admin-key-1"}


def test_admin_reload_switches_the_ingress_to_the_newest_generation(env, tmp_path):  # noqa: F811
    root = shutil.copytree(env["sharded"][2], tmp_path / "idx", symlinks=True)
    q = env["captions"][2]

    async def go():
        # index_poll_s an hour: only the admin call can switch generations here
        async with sharded_client(root, env["checkpoint"], index_poll_s=3600, api_keys="admin-key-1") as (client, _, _):
            out = {"first": (await client.post("/v1/search", json={"query": q, "k": 3})).json(),
                   "same": await client.post("/v1/admin/reload", headers=ADMIN)}
            gen = current_generation(root)
            write_generation(root, list(gen.versions))  # generation 2 (the same shard versions)
            out["moved"] = await client.post("/v1/admin/reload", headers=ADMIN)
            out["second"] = (await client.post("/v1/search", json={"query": q, "k": 3})).json()
            # generation 3 names a copy of shard 1's version whose frames are then lost: shard 1 cannot open it,
            # so the switch is refused and generation 2 stays served
            s1 = root / "shards" / "s001" / "versions"
            shutil.copytree(s1 / gen.versions[1], s1 / "v999999")
            out["bad"] = write_generation(root, [gen.versions[0], "v999999"])
            (s1 / "v999999" / "frames.npy").unlink()
            out["refused"] = await client.post("/v1/admin/reload", headers=ADMIN)
            out["third"] = (await client.post("/v1/search", json={"query": q, "k": 3})).json()
            out["anonymous"] = await client.post("/v1/admin/reload")
            return out

    o = asyncio.run(go())
    assert o["same"].status_code == 200 and o["same"].json()["reloaded"] is False, o["same"].text
    moved = o["moved"].json()
    assert o["moved"].status_code == 200 and moved["reloaded"] is True, o["moved"].text
    assert (moved["version"], moved["previous"]) == ("g000002", "g000001")
    assert o["first"]["index_version"] == "g000001" and o["second"]["index_version"] == "g000002"
    assert [h["id"] for h in o["first"]["results"]] == [h["id"] for h in o["second"]["results"]]
    assert o["bad"].number == 3
    assert o["refused"].status_code == 503 and "generation 3" in o["refused"].json()["detail"], o["refused"].text
    assert o["third"]["index_version"] == "g000002"
    assert [h["id"] for h in o["third"]["results"]] == [h["id"] for h in o["second"]["results"]]
    assert o["anonymous"].status_code == 401


def test_key_roles_apply_on_the_ingress(env):  # noqa: F811
    """The Ray ingress builds the same app: every admin route refuses a search key (403), the search routes take
    it, the admin and legacy keys reload; /metrics takes any valid key (tests.service.test_key_roles.role_matrix)."""
    from tests.service.test_key_roles import ADMIN_KEY, LEGACY_KEY, SEARCH_KEY, role_matrix

    root = env["sharded"][2]

    async def go():
        async with sharded_client(root, env["checkpoint"], index_poll_s=3600, search_keys=SEARCH_KEY,
                                  admin_keys=ADMIN_KEY, api_keys=LEGACY_KEY, require_key_for_search=True,
                                  media_secret="m" * 40) as (client, _, app):
            return await role_matrix(client, app, search_needs_key=True, metrics_need_key=True)

    got = asyncio.run(go())
    assert got["admin"][("admin", "POST", "/v1/admin/reload")] == (200, None)
    assert got["admin"][("search", "POST", "/v1/admin/reload")][0] == 403
    assert got["search_post"]["search"] == 200
