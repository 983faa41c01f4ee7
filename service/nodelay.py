"""A ``uvicorn.Config`` for ``gare-serve --workers N`` whose listening socket keeps TCP_NODELAY.

uvicorn binds the socket that its worker processes share itself and leaves the socket's ``proto`` at 0.
Accepted sockets inherit that, and asyncio sets TCP_NODELAY only when ``proto == IPPROTO_TCP``. Nagle's
algorithm then holds each keep-alive response until the client's delayed ACK: about 40 ms on every request
after a connection's first. Measured here with a trivial app, 44 ms against 1.3 ms per request; upstream
this is Kludex/uvicorn#3149. The single-process path lets asyncio build the socket from getaddrinfo
(proto 6) and is unaffected.

A module of its own, at import level: the worker processes are spawned, so the config class must be
importable by name.
"""

from __future__ import annotations

import socket

import uvicorn

__all__ = ["NodelayConfig"]


class NodelayConfig(uvicorn.Config):
    def bind_socket(self) -> socket.socket:
        sock = super().bind_socket()
        if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.proto != socket.IPPROTO_TCP:
            # the same descriptor, re-wrapped with the protocol it has (nothing is re-bound)
            fixed = socket.socket(sock.family, sock.type, socket.IPPROTO_TCP, fileno=sock.detach())
            fixed.set_inheritable(True)
            return fixed
        return sock
