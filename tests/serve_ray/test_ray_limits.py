"""The Ray Serve ingress as strict as gare-serve, on a real local Ray cluster bound to 127.0.0.1 inside a private
network namespace with only loopback (root: ``unshare -n``), started with the project's Ray environment
(``gare_serve.ray_serve.ray_node.ray_env``): Serve's proxy carries gare-serve's header timeout, body timeout, body
limits and Host check (``gare_serve.ray_serve.proxy_limits``), and no Ray process listens off the node address.

The cluster is the suite's one Ray run (tests/serve_ray/one_cluster.py, app ``limits``: a cluster start is tens of
seconds here); the checks that need no cluster (the start-up's arguments and environment, Ray's loopback rewrite)
run without one.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import uvicorn

from gare_serve.ray_serve import proxy_limits
from gare_serve.ray_serve.proxy_chain import load_limits
from gare_serve.ray_serve.ray_node import (
    check_node_address,
    is_loopback,
    ray_env,
    ray_start_args,
    serve_http_options,
)
from gare_serve.settings import Settings
from tests.serve_ray.one_cluster import (
    BAD_HOST,
    BODY_TIMEOUT_S,
    GUARD_S,
    HEADER_TIMEOUT_S,
    MAX_BODY,
    NODE,
    RAW,
    SLOW_HEADERS,
    request,
)
from tests.service.support import free_port


@pytest.fixture(scope="module")
def limits_run(ray_cluster):
    """The suite's one Ray run, app ``limits`` (tests/serve_ray/one_cluster.py): a 1-shard index behind the ingress,
    then every probe of this module."""
    steps = dict(ray_cluster["apps"]["limits"]["steps"])
    steps["raw"] = dict(zip(RAW, steps["raw"]["answers"], strict=True))
    return steps


def test_a_slow_header_client_is_cut_at_gare_serves_bound(limits_run):
    slow = limits_run["slow_headers"]
    # the server closed it: with Ray's own uvicorn it stayed open as long as the client kept sending (the guard)
    assert slow["closed_at_s"] is not None, f"the slow-header connection was still open after {GUARD_S} s: {slow}"
    assert slow["bytes_sent"] < slow["bytes_total"], slow
    assert slow["closed_at_s"] >= HEADER_TIMEOUT_S, slow  # not before the bound: the timer, not something else
    # the client had begun a request: gare-serve's 408, naming the configured bound (so it is its protocol)
    assert slow["answer"]["status"] == 408, slow
    assert f"request headers not received within {HEADER_TIMEOUT_S} s" in slow["answer"]["body"], slow


def test_a_slow_body_gets_gare_serves_408(limits_run):
    slow = limits_run["slow_body"]
    assert slow["closed_at_s"] is not None, f"the slow body was still being read after {GUARD_S} s: {slow}"
    assert slow["closed_at_s"] >= BODY_TIMEOUT_S and slow["bytes_sent"] < slow["bytes_total"], slow
    assert slow["answer"]["status"] == 408, slow
    assert f"request body not received within {BODY_TIMEOUT_S} s" in slow["answer"]["body"], slow


def test_body_limits_and_the_host_check_hold_in_front_of_the_ingress(limits_run):
    raw = limits_run["raw"]
    assert raw["readyz"]["status"] == 200, raw["readyz"]
    assert raw["search"]["status"] == 200 and '"results"' in raw["search"]["body"], raw["search"]
    for name in ("search_too_large", "search_too_large_chunked"):  # declared or counted while streaming
        assert raw[name]["status"] == 413, raw[name]
        assert f"limit {MAX_BODY} bytes" in raw[name]["body"], raw[name]
    # a Host that is not the server's name: 400 on the app's routes and on the routes Ray's proxy answers itself
    assert raw["routes"]["status"] == 200, raw["routes"]
    for name in ("readyz_bad_host", "routes_bad_host"):
        assert raw[name]["status"] == 400 and "invalid Host header" in raw[name]["body"], raw[name]


def _bound_to_node(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped  # a dual-stack socket bound to the IPv4 node address
    return str(addr) == NODE


def test_no_ray_process_listens_off_the_node_address(limits_run):
    lst = limits_run["listeners"]
    names = " ".join(p["name"] for p in lst["processes"])
    # the run's Ray processes, with the two Serve replicas that used to listen on [::]
    assert "ServeReplica" in names and "ProxyActor" in names and "raylet" in names, lst["processes"]
    off = [p for p in lst["processes"] if not _bound_to_node(p["ip"])]
    assert not off, f"Ray listeners off {NODE}: {off}"
    if lst["netns"] is not None:  # every listener of the private namespace, whoever owns it (0.0.0.0 shows as such)
        assert lst["netns"], "no listener at all in the namespace"
        off = [s for s in lst["netns"] if not _bound_to_node(s["ip"])]
        assert not off, f"listeners off {NODE} in the namespace: {off}"


# ------------------------------------------------------------------------------------------------ no cluster


def test_the_start_up_binds_every_listener_to_the_node_address():
    head = ray_start_args("10.0.0.1", head=True)
    assert "--node-ip-address=10.0.0.1" in head and "--include-dashboard=false" in head and "--head" in head
    assert "--dashboard-host=10.0.0.1" in ray_start_args("10.0.0.1", head=True, dashboard=True)
    join = ray_start_args("10.0.0.2", head=False, address="10.0.0.1:6379")
    assert "--address=10.0.0.1:6379" in join and "--node-ip-address=10.0.0.2" in join
    assert serve_http_options("10.0.0.1", 8000) == {"host": "10.0.0.1", "port": 8000}
    env = ray_env("10.0.0.1")
    assert env["RAY_SERVE_DEFAULT_HTTP_HOST"] == "10.0.0.1"
    assert env["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"] == "gare_serve.ray_serve.proxy_limits.proxy_middlewares"
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in env  # a routable address is not rewritten
    assert ray_env("127.0.0.1")["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0" and is_loopback("::1")
    for bad in ("0.0.0.0", "::", "my-host"):
        with pytest.raises(ValueError, match=repr(bad).strip("'")):
            check_node_address(bad)
    with pytest.raises(ValueError, match="head"):
        ray_start_args("10.0.0.1", head=True, address="10.0.0.1:6379")


def test_the_loopback_node_address_survives_rays_cli():
    """Ray's CLI turns --node-ip-address 127.0.0.1 into the host's routable address unless the start-up's
    environment says otherwise (ray._private.services.resolve_ip_for_localhost, what `ray start` calls)."""
    code = "from ray._private.services import resolve_ip_for_localhost as r; print(r('127.0.0.1'))"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    got = subprocess.run([sys.executable, "-c", code], env={**env, **ray_env(NODE)}, capture_output=True, text=True,
                         timeout=120)
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout.strip() == NODE


def test_the_start_up_command_line(tmp_path):
    code = subprocess.run([sys.executable, "-m", "gare_serve.ray_serve.ray_node", "--node-address", NODE, "--head",
                           "--block", "--dry-run"], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert code.returncode == 0, code.stderr[-2000:]
    line = code.stdout.strip()
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0" in line and "ray start --node-ip-address=127.0.0.1" in line
    assert line.endswith("--block")


def test_the_proxy_chain_in_uvicorn_cuts_slow_headers_and_refuses_large_bodies():
    """The same limits in a plain uvicorn server, as Ray's proxy builds one (``http`` left at "auto" resolved to the
    loaded protocol): a fast check of proxy_chain without a cluster."""
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    limits = load_limits(Settings(header_timeout_s=1.0, max_body_bytes=2048))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(limits.wrap(app), host=NODE, port=port, http=limits.protocol,
                                           lifespan="off", log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.started
        with socket.create_connection((NODE, port), timeout=15) as s:  # one byte every 0.3 s, never finished
            t0, got = time.monotonic(), b""
            for ch in SLOW_HEADERS.encode():
                try:
                    s.sendall(bytes([ch]))
                except OSError:
                    break
                s.settimeout(0.3)
                try:
                    got = s.recv(4096)
                    break
                except TimeoutError:
                    continue
            assert time.monotonic() - t0 < 10, "the slow-header connection outlived 10x the 1 s bound"
            assert got.startswith(b"HTTP/1.1 408") and b"within 1 s" in got, got
        with socket.create_connection((NODE, port), timeout=15) as s:
            s.sendall(request("POST", "/v1/search", body=b"x" * 3000).encode("latin-1"))
            assert s.recv(4096).startswith(b"HTTP/1.1 413"), "a body over max_body_bytes was not refused"
        with socket.create_connection((NODE, port), timeout=15) as s:
            s.sendall(request("GET", "/-/healthz", host=BAD_HOST).encode("latin-1"))
            assert s.recv(4096).startswith(b"HTTP/1.1 400")
    finally:
        server.should_exit = True
        th.join(timeout=30)


def test_a_connection_before_the_limits_loaded_is_refused():
    """Until the proxy's limits are loaded (a thread of the proxy process), a connection gets a 503, never an
    unchecked request (no proxy_middlewares() call in this process: nothing is loaded)."""
    assert not proxy_limits._loading.done()

    async def go() -> bytes:
        server = await asyncio.get_running_loop().create_server(proxy_limits.header_timeout_protocol, NODE, 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection(NODE, port)
        writer.write(request("GET", "/readyz").encode())
        got = await asyncio.wait_for(reader.read(), 30)
        writer.close()
        server.close()
        return got

    got = asyncio.run(go())
    assert got.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in got, got
