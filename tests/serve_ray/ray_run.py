"""The Ray part of the tests in tests/serve_ray/test_ray_serve.py, run as a child process (inside a private network
namespace with only loopback when the test runs as root): ``python -m tests.serve_ray.ray_run CONFIG.json OUT.json``.

Starts a local Ray cluster of ``nodes`` nodes bound to 127.0.0.1 (no dashboard), Serve's HTTP proxy on 127.0.0.1,
deploys ``gare_serve.ray_serve.deployment:build_app`` over a sharded index, then runs the config's ``steps`` in order and writes
what each saw to OUT.json (``out["steps"][name]``). Every answer is recorded as {status, partial, missing_shards,
index_version, hits: [[file name, id, score, ann, psi, bias], ...], detail, qi (the request's index)}. Steps:

- ``ask``: each request of ``requests`` once, in order.
- ``kill``: kill ``count`` (default all) live replicas of shard ``shard``'s deployment, no restart by hand.
- ``until_restarted``: query (round-robin over ``requests``) until Ray has a replica of ``shard`` that was not
  killed and 3 complete answers in a row came back (at most ``timeout_s``).
- ``load_while``: ``clients`` threads query in closed loop while ``command`` runs (``gare-index add`` switching the
  generation), and on until ``after`` answers of index_version ``until_version`` came back (at most ``timeout_s``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import ray
from ray import serve
from ray.cluster_utils import Cluster

from gare_serve.ray_serve.deployment import build_app, shard_deployment_name

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
        time.sleep(0.25)
    raise RuntimeError(f"the Ray Serve app did not become ready in {timeout_s} s")


def ask(client: httpx.Client, body: dict[str, Any], qi: int) -> dict[str, Any]:
    try:
        r = client.post("/v1/search", json=body)
    except httpx.HTTPError as e:  # a transport error is an answer too (counted, never dropped)
        return {"status": 0, "detail": f"{type(e).__name__}: {e}", "qi": qi, "t": time.time()}
    b = r.json() if r.headers.get("content-type", "").startswith("application/json") else {"detail": r.text}
    hits = [[h["metadata"]["name"], h["id"], h["score"], h["ann_score"], h["psi_score"], h["bias"]]
            for h in b.get("results", [])]
    return {"status": r.status_code, "partial": b.get("partial"), "missing_shards": b.get("missing_shards"),
            "index_version": b.get("index_version"), "hits": hits, "detail": b.get("detail"), "qi": qi,
            "t": time.time()}


def step_ask(client: httpx.Client, st: dict[str, Any]) -> dict[str, Any]:
    return {"answers": [ask(client, body, i) for i, body in enumerate(st["requests"])]}


def step_kill(client: httpx.Client, st: dict[str, Any]) -> dict[str, Any]:
    dep = shard_deployment_name(st["shard"])
    before = replica_names(dep)
    killed = before[: st.get("count", len(before))]
    for name in killed:
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    return {"before": before, "killed": killed, "t": time.time()}


def step_until_restarted(client: httpx.Client, st: dict[str, Any], killed: list[str]) -> dict[str, Any]:
    dep, reqs = shard_deployment_name(st["shard"]), st["requests"]
    seen: list[dict[str, Any]] = []
    t0, restarted_at = time.time(), None
    while time.time() - t0 < st.get("timeout_s", 90):
        seen.append(ask(client, reqs[len(seen) % len(reqs)], len(seen) % len(reqs)))
        now = replica_names(dep)
        if restarted_at is None and set(now) - set(killed):
            restarted_at = time.time() - t0
        tail = seen[-3:]
        if restarted_at is not None and len(tail) == 3 and all(a["status"] == 200 and not a["partial"] for a in tail):
            break
        time.sleep(0.05)
    return {"restarted_at_s": restarted_at, "replicas_after": replica_names(dep), "answers": seen}


def step_load_while(base: str, st: dict[str, Any]) -> dict[str, Any]:
    reqs, answers, stop = st["requests"], [], threading.Event()
    lock = threading.Lock()

    def client_loop(c: int) -> None:
        with httpx.Client(base_url=base, timeout=60) as cl:
            i = c
            while not stop.is_set():
                a = ask(cl, reqs[i % len(reqs)], i % len(reqs))
                with lock:
                    answers.append(a)
                i += 1

    threads = [threading.Thread(target=client_loop, args=(c,), daemon=True) for c in range(st.get("clients", 4))]
    for th in threads:
        th.start()
    t0 = time.time()
    time.sleep(st.get("before_s", 2.0))  # answers from the old generation first
    cmd = subprocess.run(st["command"], capture_output=True, text=True, env={**os.environ, **st.get("env", {})})
    t_cmd = time.time() - t0
    while time.time() - t0 < st.get("timeout_s", 120):
        with lock:
            if sum(a.get("index_version") == st["until_version"] for a in answers) >= st.get("after", 8):
                break
        time.sleep(0.2)
    stop.set()
    for th in threads:
        th.join(timeout=90)
    return {"command_rc": cmd.returncode, "command_output": (cmd.stdout + cmd.stderr)[-4000:], "command_done_s": t_cmd,
            "answers": answers}


def main(cfg: dict[str, Any]) -> dict[str, Any]:
    t_start = time.time()
    node = {"node_ip_address": LOOPBACK, "include_dashboard": False, "num_cpus": cfg.get("num_cpus", 2),
            "object_store_memory": 80 * 1024 * 1024}
    cluster = Cluster(initialize_head=True, head_node_args=dict(node))
    for _ in range(cfg.get("nodes", 2) - 1):
        cluster.add_node(**node)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    out: dict[str, Any] = {"nodes": len([n for n in ray.nodes() if n["Alive"]]),
                           "node_ips": sorted({n["NodeManagerAddress"] for n in ray.nodes()}),
                           "cluster_s": time.time() - t_start, "steps": {}}
    try:
        serve.start(http_options={"host": LOOPBACK, "port": cfg["port"]})
        t0 = time.time()
        serve.run(build_app(cfg["app"]), name="gare", route_prefix="/", blocking=False)
        base = f"http://{LOOPBACK}:{cfg['port']}"
        wait_ready(base, cfg.get("ready_timeout_s", 240))
        out["ready_s"] = time.time() - t0
        killed: dict[int, list[str]] = {}
        with httpx.Client(base_url=base, timeout=60) as client:
            for st in cfg["steps"]:
                t1 = time.time()
                if st["do"] == "ask":
                    r = step_ask(client, st)
                elif st["do"] == "kill":
                    r = step_kill(client, st)
                    killed[st["shard"]] = r["killed"]
                elif st["do"] == "until_restarted":
                    r = step_until_restarted(client, st, killed.get(st["shard"], []))
                elif st["do"] == "load_while":
                    r = step_load_while(base, st)
                else:
                    raise ValueError(f"unknown step {st['do']!r}")
                out["steps"][st["name"]] = {**r, "step_s": time.time() - t1}
    finally:
        t_down = time.time()
        # no serve.shutdown(): its graceful drain of every replica takes seconds each, and the cluster (every Ray
        # process of this run) goes with cluster.shutdown() anyway
        ray.shutdown()
        cluster.shutdown()
        out["shutdown_s"] = time.time() - t_down
        out["total_s"] = time.time() - t_start
        out["started_at"], out["ended_at"] = t_start, time.time()
    return out


if __name__ == "__main__":
    config = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps(main(config), default=str))
