"""The Ray part of tests/serve_ray/test_ray_serve.py, run as a child process (inside a private network namespace
with only loopback when the test runs as root): ``python -m tests.serve_ray.ray_run CONFIG.json OUT.json``.

Starts a local Ray cluster of several nodes bound to 127.0.0.1 (no dashboard), Serve's HTTP proxy on
127.0.0.1, deploys ``gare_serve.ray_app:build_app`` over a sharded index, and writes what it saw to OUT.json:
the answers to the text queries, then (``kill_shard``) a run of queries while one shard's replica is killed
(status, partial, missing shards and hits of each answer; whether Ray restarted the replica).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import ray
from ray import serve
from ray.cluster_utils import Cluster

from gare_serve.ray_app import build_app, shard_deployment_name

LOOPBACK = "127.0.0.1"


def replica_names(deployment: str) -> list[str]:
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith("SERVE_REPLICA::") and f"#{deployment}#" in a["name"])


def wait_ready(base: str, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            if httpx.get(base + "/readyz", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the Ray Serve app did not become ready in {timeout_s} s")


def ask(client: httpx.Client, q: str, k: int, K: int) -> dict[str, Any]:
    r = client.post("/v1/search", json={"query": q, "k": k, "candidates": K})
    body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {"detail": r.text}
    return {"status": r.status_code, **body}


def main(cfg: dict[str, Any]) -> dict[str, Any]:
    node = {"node_ip_address": LOOPBACK, "include_dashboard": False, "num_cpus": 4,
            "object_store_memory": 100 * 1024 * 1024}
    cluster = Cluster(initialize_head=True, head_node_args=dict(node))
    for _ in range(cfg.get("nodes", 2) - 1):
        cluster.add_node(**node)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    out: dict[str, Any] = {"nodes": len([n for n in ray.nodes() if n["Alive"]]),
                           "node_ips": sorted({n["NodeManagerAddress"] for n in ray.nodes()})}
    try:
        serve.start(http_options={"host": LOOPBACK, "port": cfg["port"]})
        t0 = time.time()
        serve.run(build_app(cfg["app"]), name="gare", route_prefix="/", blocking=False)
        base = f"http://{LOOPBACK}:{cfg['port']}"
        wait_ready(base, cfg.get("ready_timeout_s", 240))
        out["ready_s"] = time.time() - t0
        with httpx.Client(base_url=base, timeout=60) as client:
            out["answers"] = [ask(client, q, cfg["k"], cfg["K"]) for q in cfg["queries"]]
            if cfg.get("kill_shard") is not None:
                out["fault"] = kill_run(client, cfg)
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
    return out


def kill_run(client: httpx.Client, cfg: dict[str, Any]) -> dict[str, Any]:
    """Kill shard ``kill_shard``'s replica(s), then query until Ray has started a new one and it answers."""
    dep = shard_deployment_name(cfg["kill_shard"])
    before = replica_names(dep)
    for name in before:
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    seen, t0, restarted_at = [], time.time(), None
    queries = cfg["queries"]
    while time.time() - t0 < cfg.get("fault_timeout_s", 90):
        a = ask(client, queries[len(seen) % len(queries)], cfg["k"], cfg["K"])
        seen.append({**a, "t": time.time() - t0, "qi": len(seen) % len(queries)})
        now = replica_names(dep)
        if restarted_at is None and now and not set(now) & set(before):
            restarted_at = time.time() - t0
        tail = seen[-3:]
        if restarted_at is not None and len(tail) == 3 and all(x["status"] == 200 and not x.get("partial") for x in tail):
            break
        time.sleep(0.05)
    return {"killed": before, "replicas_after": replica_names(dep), "restarted_at_s": restarted_at, "answers": seen}


if __name__ == "__main__":
    config = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps(main(config), default=str))
