"""The uvicorn ``Config`` of ``gare-serve --workers N`` (:class:`NodelayConfig`): TCP_NODELAY on the shared
socket, the HTTP limits, and workers that die with their supervisor.

TCP_NODELAY. uvicorn binds the socket that its worker processes share itself and leaves the socket's ``proto``
at 0. Accepted sockets inherit that, and asyncio sets TCP_NODELAY only when ``proto == IPPROTO_TCP``. Nagle's
algorithm then holds each keep-alive response until the client's delayed ACK, on every request after a
connection's first (upstream this is Kludex/uvicorn#3149; ``tests/service/test_nodelay.py`` checks the accepted
sockets). :meth:`NodelayConfig.bind_socket` re-wraps that socket with ``IPPROTO_TCP``; the per-worker sockets of
``gare_serve.processes.port_group`` are made with it, and the single-process path lets asyncio build the socket
from getaddrinfo (proto 6), so neither needs this.

HTTP limits. :class:`NodelayConfig` is a :class:`gare_serve.web.http_limits.LimitsConfig`: the header-timeout
protocol and its timeout are pickled with the config into every spawned worker.

Parent death. Each worker loads its config first thing; :meth:`NodelayConfig.load` asks Linux for SIGTERM when
the supervisor dies (``gare_serve.processes.worker_lifetime.die_with_parent``).

A module of its own, at import level: the worker processes are spawned, so the config class must be importable
by name.
"""

from __future__ import annotations

import os
import socket

from gare_serve.processes.worker_lifetime import die_with_parent
from gare_serve.web.http_limits import LimitsConfig

__all__ = ["NodelayConfig"]


class NodelayConfig(LimitsConfig):
    """uvicorn's ``Config`` with the HTTP limits, an ``IPPROTO_TCP`` shared socket, and workers that die with
    the supervisor that built it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.supervisor_pid = os.getpid()  # built in the supervisor, pickled into each worker

    def bind_socket(self) -> socket.socket:
        sock = super().bind_socket()
        if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.proto != socket.IPPROTO_TCP:
            # the same descriptor, re-wrapped with the protocol it has (nothing is re-bound)
            fixed = socket.socket(sock.family, sock.type, socket.IPPROTO_TCP, fileno=sock.detach())
            fixed.set_inheritable(True)
            return fixed
        return sock

    def load(self) -> None:
        # Each worker's uvicorn Server loads its config first thing, with its signal handlers already
        # installed (the SIGTERM from PR_SET_PDEATHSIG is a graceful shutdown); the supervisor never loads it.
        if os.getpid() != self.supervisor_pid:
            die_with_parent(self.supervisor_pid)
        super().load()
