"""gare-serve --workers N: accepted connections get TCP_NODELAY (gare_serve/processes/uvicorn_config.py).

Without it every keep-alive response after a connection's first waits ~40 ms for the client's delayed ACK.
"""

from __future__ import annotations

import asyncio
import os
import socket

from gare_serve.processes.uvicorn_config import NodelayConfig


def _accepted_nodelay(listener: socket.socket) -> tuple[int, int]:
    """(proto, TCP_NODELAY) of a connection accepted by asyncio on `listener`, as uvicorn's workers accept."""
    seen: dict[str, tuple[int, int]] = {}

    class Probe(asyncio.Protocol):
        def connection_made(self, transport):
            s = transport.get_extra_info("socket")
            seen["v"] = (s.proto, s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    async def main():
        server = await asyncio.get_running_loop().create_server(Probe, sock=listener)
        host, port = listener.getsockname()[:2]
        _, w = await asyncio.open_connection(host, port)
        for _ in range(100):
            if "v" in seen:
                break
            await asyncio.sleep(0.01)
        w.close()
        server.close()
        await server.wait_closed()

    asyncio.run(main())
    return seen["v"]


def test_the_shared_socket_gives_accepted_connections_tcp_nodelay():
    config = NodelayConfig("gare_serve.app:create_app", factory=True, host="127.0.0.1", port=0, workers=2)
    sock = config.bind_socket()
    assert sock.proto == socket.IPPROTO_TCP and sock.get_inheritable()
    sock.listen(8)
    proto, nodelay = _accepted_nodelay(sock)
    assert proto == socket.IPPROTO_TCP and nodelay != 0


def test_serve_workers_runs_uvicorns_supervisor_on_that_socket(monkeypatch, tmp_path):
    import uvicorn.supervisors

    from gare_serve import cli
    from gare_serve.settings import Settings

    got = {}

    class FakeMultiprocess:
        def __init__(self, config, sockets):
            got["config"], got["sockets"] = config, sockets

        def run(self):
            got["ran"] = True

    monkeypatch.setattr(uvicorn.supervisors, "Multiprocess", FakeMultiprocess)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "prom"))
    settings = Settings(index=tmp_path, host="127.0.0.1", port=0, torch_threads=1)
    saved = dict(os.environ)  # serve_workers exports GARE_* for its workers: keep them out of later tests
    try:
        assert cli.serve_workers(settings, 3) == 0
        assert got["ran"] and isinstance(got["config"], NodelayConfig) and got["config"].workers == 3
        assert got["config"].factory and got["config"].app == "gare_serve.app:create_app"
        (sock,) = got["sockets"]
        assert sock.proto == socket.IPPROTO_TCP
    finally:
        os.environ.clear()
        os.environ.update(saved)
        for s in got.get("sockets", []):
            s.close()
