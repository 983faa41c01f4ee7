"""The one Ray cluster of the fast suite: every test that needs a real cluster reads its part of a single run of
tests.serve_ray.ray_run (a cluster start with its imports is tens of seconds on 2 cores; one start instead of three).
Three apps are deployed one after the other on the same 2-node cluster, started with the project's Ray environment
(``gare_serve.ray_serve.ray_node.ray_env``) and short gare-serve limits:

* ``limits`` (tests/serve_ray/test_ray_limits.py): a 1-shard index; the listeners, raw requests, slow clients;
* ``ncl`` (tests/serve_ray/test_sharded_ncl_default.py): the 2-shard index whose recorded NCL default is on;
* ``shards`` (tests/serve_ray/test_ray_serve.py): the 2-shard index built by the CLI, its answers against the single
  index's, the stage-1 recall watch's metrics on the ingress's /metrics, then every replica of shard 1 killed (last:
  the app is not used after it).

Every ingress records the query bank (``bank_path``: each app's ingress loads what the one before wrote and adds
its own text queries) and samples every text query for the recall watch.

The modules that read the run are listed in tests/conftest.py (``CLUSTER_READERS``): they run on one test process.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from gare_index.shards import shard_root
from gare_serve.ray_serve.ray_node import ray_env
from tests.serve_ray.support import text_requests
from tests.service.support import free_port

NODE = "127.0.0.1"
HEADER_TIMEOUT_S, BODY_TIMEOUT_S, MAX_BODY = 4, 6, 4096  # GARE_* of the cluster: short, so the module is quick
EVERY_S = 2.0  # the slow client's pace: one byte every 2 s
GUARD_S = 60.0  # hang guard of a slow client: 10x and more the timeouts above
BAD_HOST = "rebind.example"


def request(method: str, path: str, host: str = NODE, body: bytes = b"", headers: dict[str, str] | None = None,
            chunks: list[bytes] | None = None) -> str:
    """A raw HTTP/1.1 request (latin-1 text for ray_run's ``raw`` step); ``chunks``: a chunked body instead."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", "Connection: close", *(f"{k}: {v}" for k, v in
                                                                                 (headers or {}).items())]
    if chunks is not None:
        lines.append("Transfer-Encoding: chunked")
        payload = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
    else:
        if body or method == "POST":
            lines.append(f"Content-Length: {len(body)}")
        payload = body
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1").decode("latin-1") + payload.decode("latin-1")


JSON = {"Content-Type": "application/json"}
BIG = b'{"query": "' + b"a" * (MAX_BODY + 100) + b'"}'
RAW = {
    "readyz": request("GET", "/readyz"),
    "readyz_bad_host": request("GET", "/readyz", host=BAD_HOST),
    "routes": request("GET", "/-/routes"),  # answered by Ray's proxy itself, never by the ingress
    "routes_bad_host": request("GET", "/-/routes", host=BAD_HOST),
    "search": request("POST", "/v1/search", body=b'{"query": "a dog", "k": 3}', headers=JSON),
    "search_too_large": request("POST", "/v1/search", body=BIG, headers=JSON),
    "search_too_large_chunked": request("POST", "/v1/search", chunks=[BIG[i:i + 1000] for i in range(0, len(BIG), 1000)],
                                        headers=JSON),
}
SLOW_HEADERS = "GET /readyz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + "a" * 60  # never finished: 120 s at 2 s/byte
SLOW_BODY_HEAD = ("POST /v1/search HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  "Content-Length: 200\r\n\r\n")
NCL_QUERY = "a red circle moves left"
NCL_REQUESTS = [{"query": NCL_QUERY, "k": 5}, {"query": NCL_QUERY, "k": 5, "ncl": False},
                {"query": NCL_QUERY, "k": 5, "ncl": True}]


# what the shards app's /metrics must show once the watch has evaluated its 5 complete text answers
RECALL_DONE = ["gare_stage1_recall_window_queries 5.0"]
# the text queries every app's ingress searched, in order (the bank's rows): the limits app's raw search, the ncl app's
BANKED_BEFORE_SHARDS = ["a dog", NCL_QUERY, NCL_QUERY, NCL_QUERY]


def shard_requests(captions: list[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The shards app's text requests (2 captions, NCL off and on) and one asking for every video (k = 16)."""
    return text_requests(captions, 2), {"query": captions[2], "k": 16, "candidates": 16, "ncl": True}


def cluster_config(n1: Path, ncl_on: Path, n2: Path, captions: list[str],
                   bank_path: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """(ray_run's config, the cluster's environment)."""
    reqs, everything = shard_requests(captions)
    apps = [
        {"name": "limits",
         "app": {"index": str(n1), "shard_replicas": 1, "allow_partial": False, "shard_timeout_s": 30},
         "steps": [{"do": "listeners", "name": "listeners", "netns": os.geteuid() == 0},
                   {"do": "raw", "name": "raw", "requests": list(RAW.values())},
                   {"do": "slow", "name": "slow_headers", "trickle": SLOW_HEADERS, "every_s": EVERY_S,
                    "guard_s": GUARD_S},
                   {"do": "slow", "name": "slow_body", "head": SLOW_BODY_HEAD, "trickle": '{"query": "' + "a" * 150,
                    "every_s": EVERY_S, "guard_s": GUARD_S}]},
        {"name": "ncl",
         "app": {"index": str(ncl_on), "shard_replicas": 1, "allow_partial": False, "shard_timeout_s": 10},
         "steps": [{"do": "ask", "name": "answers", "requests": NCL_REQUESTS}]},
        # shard_timeout_s 10 (the default): at 4, a CI run on a machine loaded by another job saw both shards miss
        # the first request (answered partial, shards [0, 1] missing); the dead shard is still flagged within it
        {"name": "shards",
         "app": {"index": str(n2), "shard_replicas": 1, "allow_partial": True, "shard_timeout_s": 10},
         "steps": [{"do": "ask", "name": "answers", "requests": [*reqs, everything]},
                   {"do": "metrics", "name": "recall", "until": RECALL_DONE, "prefix": "gare_stage1_recall",
                    "timeout_s": 60},
                   # a replacement replica starts within the shard timeout on a quiet machine (the ingress then
                   # waits for it and answers in full): with the folder hidden none can, so shard 1 stays down
                   {"do": "kill", "name": "kill", "shard": 1, "hide": str(shard_root(n2, 1))},
                   {"do": "ask", "name": "after_kill", "requests": [everything]}]},
    ]
    # one proxy (on the head): a slow client or a raw request must meet the proxy whose limits are under test
    cfg = {"port": free_port(), "nodes": 2, "num_cpus": 2, "timeout_s": 900, "start_tries": 3, "apps": apps,
           "proxy_location": "HeadOnly"}
    env = {**ray_env(NODE), "GARE_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S), "GARE_BODY_TIMEOUT_S": str(BODY_TIMEOUT_S),
           "GARE_MAX_BODY_BYTES": str(MAX_BODY),
           # what the ingress records of its traffic: every text query in the bank, written at once, and sampled for
           # the recall watch, whose probes run unpaced on these tiny shards
           "GARE_QUERY_BANK_SIZE": "1000", "GARE_QUERY_BANK_PATH": str(bank_path), "GARE_QUERY_BANK_FLUSH_EVERY": "1",
           "GARE_RECALL_SAMPLE_RATE": "1", "GARE_RECALL_CPU_SHARE": "1",
           # a host loaded by other jobs: give the dashboard agent time to register (not a product setting)
           "RAY_agent_register_timeout_ms": "120000"}
    return cfg, env
