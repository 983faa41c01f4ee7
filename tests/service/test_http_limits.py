"""Slow-client bounds (gare_serve/web/http_limits.py): the header timeout of the h11 protocol and the body timeout
middleware, in process (a trivial app on a real uvicorn server; the middleware with stalling ASGI receives)
and on a real `gare-serve --workers 2` (the protocol reaches the spawned workers)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import pickle
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from pydantic import BaseModel

from gare_serve.web.http_limits import BodyTimeoutMiddleware, HeaderTimeoutH11Protocol, LimitsConfig
from tests.service.support import UvicornProcess, copy_index, free_port

# How long a test keeps the connection before it calls the server hung: ten times the 1-s header timeout.
# No upper bound on when the server closes is asserted: what closes it is told by what it sends (a 408 naming the
# header timeout, or nothing for a request never begun); the lower bounds say it did not close early.
HANG_S = 10.0


# ------------------------------------------------------------------------------------------------- helpers
def _read_until_closed(sock: socket.socket, limit_s: float) -> tuple[bytes, float | None]:
    """(everything received, seconds until the peer closed) reading for at most `limit_s`; None: still open."""
    t0 = time.monotonic()
    got = b""
    while time.monotonic() - t0 < limit_s:
        sock.settimeout(max(0.05, limit_s - (time.monotonic() - t0)))
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            return got, None
        except ConnectionResetError:
            return got, time.monotonic() - t0
        if not chunk:
            return got, time.monotonic() - t0
        got += chunk
    return got, None


def _trickle(sock: socket.socket, data: bytes, every_s: float, limit_s: float) -> tuple[bytes, float | None]:
    """Send `data` one byte every `every_s` until the server closes (or `limit_s` from the start): (what the
    server sent, seconds from the start until it closed; None if it never did)."""
    t0 = time.monotonic()
    got = b""
    for b in data:
        try:
            sock.sendall(bytes([b]))
        except (BrokenPipeError, ConnectionResetError):
            break
        sock.settimeout(every_s)
        try:
            chunk = sock.recv(65536)
            if not chunk:
                return got, time.monotonic() - t0
            got += chunk
        except TimeoutError:
            pass
        except ConnectionResetError:
            return got, time.monotonic() - t0
        if time.monotonic() - t0 > limit_s:
            return got, None
    rest, closed_after = _read_until_closed(sock, max(0.1, limit_s - (time.monotonic() - t0)))
    return got + rest, None if closed_after is None else time.monotonic() - t0


def _read_response(sock: socket.socket, timeout_s: float = 30) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a Content-Length, read off a keep-alive socket."""
    sock.settimeout(timeout_s)
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {buf!r}"
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    n = int(headers["content-length"])
    while len(body) < n:
        chunk = sock.recv(65536)
        assert chunk, "connection closed in the middle of a response body"
        body += chunk
    assert len(body) == n, "more bytes than the response's Content-Length"
    return status, headers, body


def _request(method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None) -> bytes:
    h = {"Host": "127.0.0.1", **(headers or {})}
    if body or method == "POST":
        h.setdefault("Content-Type", "application/json")
        h["Content-Length"] = str(len(body))
    return (f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items()) + "\r\n").encode() + body


SLOW_HEADERS = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"a" * 200 + b"\r\n\r\n"


# ------------------------------------------------------------------- the protocol on a real uvicorn server
async def _echo_app(scope, receive, send):
    """Reads the whole body, answers its length; `/slow` waits 1.5 s first."""
    if scope["type"] != "http":
        return
    n = 0
    more = True
    while more:
        msg = await receive()
        n += len(msg.get("body", b""))
        more = msg.get("more_body", False)
    if scope["path"] == "/slow":
        await asyncio.sleep(1.5)
    body = json.dumps({"received": n}).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


@contextlib.contextmanager
def _uvicorn_server(app, **limits):
    """(port, the uvicorn Server) of `app` served in a thread with LimitsConfig(**limits)."""
    port = free_port()
    config = LimitsConfig(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off", **limits)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        yield port, server
    finally:
        server.should_exit = True
        thread.join(20)


@contextlib.contextmanager
def _uvicorn_in_thread(app, header_timeout_s: float):
    with _uvicorn_server(app, header_timeout_s=header_timeout_s) as (port, _):
        yield port


def test_trickled_headers_get_408_and_close_at_the_deadline():
    with _uvicorn_in_thread(_echo_app, header_timeout_s=1.0) as port:
        with socket.create_connection(("127.0.0.1", port)) as s:
            got, closed_after = _trickle(s, SLOW_HEADERS, every_s=0.2, limit_s=HANG_S)
        assert closed_after is not None, "a client trickling its headers kept the connection open"
        assert closed_after >= 0.8, closed_after  # not before the deadline (the headers take 46 s to trickle)
        assert got.startswith(b"HTTP/1.1 408 "), got
        assert json.loads(got.partition(b"\r\n\r\n")[2])["detail"].startswith("request headers not received")


def test_idle_connection_is_closed_without_a_response():
    with _uvicorn_in_thread(_echo_app, header_timeout_s=1.0) as port:
        with socket.create_connection(("127.0.0.1", port)) as s:
            got, closed_after = _read_until_closed(s, HANG_S)
        assert closed_after is not None and closed_after >= 0.8, closed_after
        assert got == b""  # no 408 for a request never begun


def test_clock_restarts_after_each_response_and_stops_while_a_request_runs():
    with _uvicorn_in_thread(_echo_app, header_timeout_s=1.0) as port:
        with socket.create_connection(("127.0.0.1", port)) as s:
            # keep-alive: four requests on one connection, 0.7 s apart: 2.1 s after it opened, still served
            for i in range(3):
                s.sendall(_request("POST", "/echo", b"x" * (i + 1)))
                status, _, body = _read_response(s)
                assert status == 200 and json.loads(body) == {"received": i + 1}
                time.sleep(0.7)
            # a request whose answer takes longer than the header timeout: its headers were in, no timeout
            s.sendall(_request("GET", "/slow"))
            assert _read_response(s)[0] == 200
            # and after that response the next request's headers have the whole second again, no more
            got, closed_after = _trickle(s, SLOW_HEADERS, every_s=0.2, limit_s=HANG_S)
            assert closed_after is not None and got.startswith(b"HTTP/1.1 408 "), got
            # the 408 is the header timeout's, whose clock restarted with this request (not the /slow one's
            # wait): a clock still running from before would have closed the connection during /slow
            assert json.loads(got.partition(b"\r\n\r\n")[2])["detail"].startswith("request headers not received")
            assert closed_after >= 0.8, closed_after


def test_the_configs_carry_the_protocol_to_spawned_workers():
    from gare_serve.processes.uvicorn_config import NodelayConfig

    cfg = NodelayConfig("gare_serve.app:create_app", factory=True, workers=2, header_timeout_s=3.5,
                        send_timeout_s=7.5, send_buffer_bytes=123_456)
    clone = pickle.loads(pickle.dumps(cfg))  # what uvicorn's spawn hands each worker
    assert clone.http is HeaderTimeoutH11Protocol and clone.header_timeout_s == 3.5
    assert (clone.send_timeout_s, clone.send_buffer_bytes) == (7.5, 123_456)
    assert LimitsConfig("gare_serve.app:create_app").http is HeaderTimeoutH11Protocol


def test_gare_serve_one_process_serves_with_the_limits(monkeypatch, service_env):
    from gare_serve import cli

    got = {}

    class FakeServer:
        def __init__(self, config):
            got["config"] = config
            self.started = True

        def run(self):
            pass

    monkeypatch.setattr(uvicorn, "Server", FakeServer)
    rc = cli.main(["--index", str(service_env["index"]), "--workers", "1", "--header-timeout-s", "4.5",
                   "--body-timeout-s", "7", "--log-level", "warning"])
    assert rc == 0
    config = got["config"]
    assert config.http is HeaderTimeoutH11Protocol and config.header_timeout_s == 4.5
    assert config.timeout_graceful_shutdown == cli.GRACEFUL_SHUTDOWN_S
    # the app wraps its routes in the body timeout, at the configured value
    limits = [m for m in config.app.user_middleware if m.cls is BodyTimeoutMiddleware]
    assert len(limits) == 1 and limits[0].kwargs["timeout_s"] == 7


# ------------------------------------------------------------------------- the middleware, unit level
async def _drive(app, receive, path="/v1/search"):
    sent: list[dict] = []

    async def send(msg):
        sent.append(msg)

    scope = {"type": "http", "method": "POST", "path": path, "headers": [], "query_string": b""}
    await app(scope, receive, send)
    return sent


def _stalling_receive(first: bytes):
    calls = {"n": 0}

    async def receive():
        calls["n"] += 1
        if calls["n"] == 1:
            return {"type": "http.request", "body": first, "more_body": True}
        await asyncio.Event().wait()  # the rest never comes

    return receive


def test_middleware_answers_408_when_the_body_stalls():
    async def app(scope, receive, send):
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": []})  # never reached
        await send({"type": "http.response.body", "body": b"ok"})

    t0 = time.monotonic()
    driven = _drive(BodyTimeoutMiddleware(app, timeout_s=0.3), _stalling_receive(b'{"query": "a'))
    sent = asyncio.run(asyncio.wait_for(driven, 10 * 0.3))  # hang guard: the receive never returns by itself
    assert time.monotonic() - t0 >= 0.25  # not before the timeout
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[0]["status"] == 408 and (b"connection", b"close") in sent[0]["headers"]
    assert json.loads(sent[1]["body"])["detail"] == "request body not received within 0.3 s"


class _Query(BaseModel):
    query: str


def test_middleware_408_wins_over_the_frameworks_400():
    """FastAPI turns an exception raised while reading the body into a 400: the 408 is sent first, the
    app's answer dropped."""
    from fastapi import FastAPI

    api = FastAPI()

    @api.post("/v1/search")
    async def search(q: _Query):
        return {"query": q.query}

    sent = asyncio.run(_drive(BodyTimeoutMiddleware(api, timeout_s=0.3), _stalling_receive(b'{"query": "a')))
    starts = [m for m in sent if m["type"] == "http.response.start"]
    assert [m["status"] for m in starts] == [408]


def test_middleware_bounds_only_the_body():
    """A complete body passes; waiting for a disconnect after it (streaming responses do) is not bounded."""

    async def app(scope, receive, send):
        msg = await receive()
        assert msg == {"type": "http.request", "body": b"{}", "more_body": False}
        assert (await receive())["type"] == "http.disconnect"  # arrives after the deadline
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    calls = {"n": 0}

    async def receive():
        calls["n"] += 1
        if calls["n"] == 1:
            return {"type": "http.request", "body": b"{}", "more_body": False}
        await asyncio.sleep(0.5)
        return {"type": "http.disconnect"}

    sent = asyncio.run(_drive(BodyTimeoutMiddleware(app, timeout_s=0.2), receive))
    assert sent[0]["status"] == 200

    async def lifespan_app(scope, receive, send):
        assert scope["type"] == "lifespan"
        got["lifespan"] = await receive()

    got = {}

    async def lifespan_receive():
        await asyncio.sleep(0.3)  # longer than the timeout: not an HTTP body, not bounded
        return {"type": "lifespan.startup"}

    asyncio.run(BodyTimeoutMiddleware(lifespan_app, timeout_s=0.1)({"type": "lifespan"}, lifespan_receive, None))
    assert got["lifespan"] == {"type": "lifespan.startup"}


# --------------------------------------------------------------- the send timeout and the kernel buffer
TCP_CLOSE, TCP_CLOSE_WAIT = 7, 8  # Linux TCP states (the first byte of TCP_INFO)


async def _big_app(scope, receive, send):
    """`GET /big?n=BYTES` answers n fresh bytes in one send (as the JSON responses of gare-serve do)."""
    if scope["type"] != "http":
        return
    n = int(scope["query_string"].decode().partition("=")[2] or 8 << 20)
    body = bytes(n)  # a fresh buffer per request, freed only when the transport lets go of it
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/octet-stream"), (b"content-length", str(n).encode())]})
    await send({"type": "http.response.body", "body": body})


def _tcp_state(sock: socket.socket) -> int:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]


def _unread_client(port: int, n: int, rcvbuf: int = 4096) -> socket.socket:
    """A client that asks for n bytes and never reads them (a small receive window: the answer stalls)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", port))
    s.sendall(_request("GET", f"/big?n={n}"))
    return s


def _until(cond, limit_s: float, every_s: float = 0.05) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        if cond():
            return time.monotonic() - t0
        time.sleep(every_s)
    return None


def test_a_client_that_never_reads_is_reset_after_the_send_timeout():
    """Before: the answer waited in the server's buffers for as long as the client kept the connection."""
    with _uvicorn_server(_big_app, send_timeout_s=1.0, send_buffer_bytes=64 * 1024) as (port, server):
        with _unread_client(port, 8 << 20) as s:
            reset_after = _until(lambda: _tcp_state(s) in (TCP_CLOSE, TCP_CLOSE_WAIT), HANG_S)
            assert reset_after is not None, "a client that never read its answer was never dropped"
            assert reset_after >= 0.8, reset_after  # not before the send timeout
            assert _tcp_state(s) == TCP_CLOSE  # a reset (SO_LINGER 0), not a FIN queued behind 8 MB
            assert _until(lambda: not server.server_state.connections, HANG_S) is not None


def test_a_slow_reader_that_keeps_reading_gets_its_whole_answer():
    n = 512 * 1024
    with _uvicorn_server(_big_app, send_timeout_s=0.5, send_buffer_bytes=16 * 1024) as (port, _):
        with _unread_client(port, n, rcvbuf=8192) as s:
            got = b""
            t0 = time.monotonic()
            while len(got.partition(b"\r\n\r\n")[2]) < n and time.monotonic() - t0 < 60:
                time.sleep(0.05)  # about 16 KB taken every 0.05 s: slower than the server sends, never idle 0.5 s
                chunk = s.recv(16 * 1024)
                assert chunk, f"the server closed a connection that kept reading after {len(got)} bytes"
                got += chunk
            head, _, body = got.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200 ") and len(body) == n, (head, len(body))
            print(f"slow reader: {n} bytes in {time.monotonic() - t0:.1f} s with a 0.5-s send timeout")


def test_accepted_sockets_get_the_bounded_send_buffer():
    """Before: Linux autotuned each accepted socket's send buffer up to net.ipv4.tcp_wmem's maximum (4 MiB)."""
    with _uvicorn_server(_big_app, send_buffer_bytes=96 * 1024) as (port, server):
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(_request("GET", "/big?n=10"))
            assert _read_response(s)[0] == 200
            (conn,) = server.server_state.connections  # the keep-alive connection, server side
            sock = conn.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == 2 * 96 * 1024  # Linux doubles it


_BIG_SERVER = """
import sys, uvicorn
sys.path[:0] = sys.argv[3].split(":")
from gare_serve.web.http_limits import LimitsConfig
from tests.service.test_http_limits import _big_app
uvicorn.Server(LimitsConfig(_big_app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", lifespan="off",
                            send_timeout_s=float(sys.argv[2]), send_buffer_bytes=64 * 1024)).run()
"""


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS:"))


def test_memory_held_for_unread_answers_is_given_back_while_the_clients_linger():
    """12 clients each ask for 8 MB and never read (96 MB of answers) and keep their connections: after the send
    timeout the server process is back within 20 MiB of its RSS before them (before: ~96 MB more, held until the
    clients went away). bench/http_unread.py measures the same on gare-serve."""
    import subprocess
    import sys

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", _BIG_SERVER, str(port), "1.0", ":".join(p for p in sys.path if p)])
    try:
        assert _until(lambda: _can_connect(port), 600, 0.5) is not None, "the test server did not start"  # imports torch
        with socket.create_connection(("127.0.0.1", port)) as warm:  # every code path once, its answer read
            warm.sendall(_request("GET", f"/big?n={8 << 20}"))
            assert _read_response(warm)[0] == 200
        time.sleep(0.5)
        before = _rss(proc.pid)
        clients = [_unread_client(port, 8 << 20) for _ in range(12)]
        try:
            dropped = _until(lambda: all(_tcp_state(s) == TCP_CLOSE for s in clients), HANG_S)
            time.sleep(0.5)
            after = _rss(proc.pid)
            print(f"RSS before {before >> 20} MiB, after the drops (clients still open) {after >> 20} MiB")
            assert dropped is not None, [_tcp_state(s) for s in clients]
            assert after - before <= 20 << 20, (before >> 20, after >> 20)
        finally:
            for s in clients:
                s.close()
    finally:
        proc.terminate()
        proc.wait(20)


def _can_connect(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


# -------------------------------------------------------------------------------- a real gare-serve
HEADER_S = 2.0
BODY_S = 2.0


@pytest.fixture(scope="module")
def server(service_env, tmp_path_factory):
    idx = copy_index(service_env["index"], tmp_path_factory.mktemp("limits") / "index")
    # --workers 2: the limits must reach the spawned workers (the one-process path is tested above)
    env = {"GARE_HEADER_TIMEOUT_S": str(HEADER_S), "GARE_BODY_TIMEOUT_S": str(BODY_S), "GARE_WORKER_HEALTHCHECK_S": "900"}
    with UvicornProcess(["--index", str(idx), "--workers", "2"], env=env, ready_timeout_s=600) as srv:
        yield srv, service_env


def test_slowloris_headers_are_cut_off_while_others_are_served(server):
    srv, _ = server
    answered: list[int] = []
    stop = threading.Event()

    def others():
        with httpx.Client(base_url=srv.base_url, timeout=10) as c:
            while not stop.is_set():
                answered.append(c.get("/healthz").status_code)
                time.sleep(0.1)

    t = threading.Thread(target=others)
    t.start()
    try:
        with socket.create_connection(("127.0.0.1", srv.port)) as s:
            got, closed_after = _trickle(s, SLOW_HEADERS, every_s=0.5, limit_s=10 * HEADER_S)  # hang guard
    finally:
        stop.set()
        t.join(20)
    print(f"slow headers: closed after {closed_after} s (bound {HEADER_S} s); {len(answered)} other requests meanwhile")
    assert closed_after is not None, f"a client sending one header byte every 0.5 s was never cut off: {got!r}"
    assert closed_after >= HEADER_S - 0.3, closed_after  # not before the deadline (all headers: 115 s)
    assert got.startswith(b"HTTP/1.1 408 "), got
    assert json.loads(got.partition(b"\r\n\r\n")[2])["detail"].startswith("request headers not received")
    assert len(answered) >= 5 and set(answered) == {200}, answered


def test_trickled_body_gets_408(server):
    srv, sh = server
    body = json.dumps({"query": sh["captions"][0], "k": 3}).encode()
    with socket.create_connection(("127.0.0.1", srv.port)) as s:
        s.sendall(_request("POST", "/v1/search", body)[: -len(body)])  # the headers, complete
        got, closed_after = _trickle(s, body, every_s=0.5, limit_s=10 * BODY_S)  # hang guard
    print(f"slow body: closed after {closed_after} s (bound {BODY_S} s)")
    assert closed_after is not None, f"a body trickled one byte every 0.5 s was never cut off: {got!r}"
    head, _, payload = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), got
    assert json.loads(payload)["detail"] == f"request body not received within {BODY_S:g} s"


def test_requests_with_bodies_and_keep_alive_still_work(server):
    srv, sh = server
    with socket.create_connection(("127.0.0.1", srv.port)) as s:
        for caption in sh["captions"][:2]:  # two requests on one connection
            s.sendall(_request("POST", "/v1/search", json.dumps({"query": caption, "k": 3}).encode()))
            status, headers, payload = _read_response(s)
            assert status == 200, payload
            assert len(json.loads(payload)["results"]) == 3 and headers.get("connection") != "close"
            time.sleep(HEADER_S * 0.6)  # twice that since the connection opened: the clock restarts per request
