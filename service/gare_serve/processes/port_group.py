"""The listening sockets of ``gare-serve --workers N``: a socket per worker in one port group (SO_REUSEPORT,
:class:`PortGroup`, :func:`bind_worker_socket`) or one socket shared by every worker (:func:`resolve_worker_sockets`
chooses).

A socket per worker (``worker_sockets`` ``reuseport``, the default on Linux). With one listening socket shared
by every worker, each worker's event loop waits on it and the first one awake accepts every connection queued
there (asyncio accepts up to ``backlog`` per wake-up): a burst of keep-alive clients can land whole on one
worker and stay there while the other idles (``bench/results/worker_spread.md``). With SO_REUSEPORT each
worker listens on a socket of its own bound to the same address; Linux hashes each new connection over the
listening sockets of the group (the connection's addresses and ports), so every worker gets its share
whatever the clients' pattern, and a worker that is still loading (bound, not yet listening) or dead gets none.
How the group is held:

- The parent binds the port first, the ordinary way (SO_REUSEADDR, no SO_REUSEPORT): that fails with
  EADDRINUSE if anything listens there or holds it (another ``gare-serve`` included, in any mode), so the
  start fails at once, before any model is loaded; port 0 gets a free port here, which every worker then
  binds. On the bound socket it then sets SO_REUSEPORT and clears SO_REUSEADDR, and keeps it, bound and never
  listening (a socket that does not listen receives no connections), for the life of the group: while no
  worker listens (start-up, every worker restarting) the port stays reserved, and a later socket without
  SO_REUSEPORT, with or without SO_REUSEADDR, or one of another user, gets EADDRINUSE (Linux only admits a
  socket of the same effective user that sets SO_REUSEPORT to a port group).
- That anchor is the one entry of the supervisor's socket list (:class:`PortGroupSocket`). Pickled into a
  spawned worker (uvicorn's ``Multiprocess`` hands its sockets to every worker it starts or restarts), it
  becomes that worker's own socket, bound there with SO_REUSEADDR and SO_REUSEPORT (:func:`bind_worker_socket`;
  SO_REUSEADDR so that its connections left in TIME_WAIT never block the next start's first bind); uvicorn
  listens on it once the worker's app has started. A restarted worker therefore binds a new socket.
- What it cannot stop: a process of the same user that itself sets SO_REUSEPORT on the same address joins
  the group (the kernel's rule: a port group belongs to one user). Run the service as its own user, or in its
  own network namespace (a container), where no such process exists.
- A worker that dies drops the connections still waiting in its accept queue (the shared socket keeps them
  for another worker); Linux's ``net.ipv4.tcp_migrate_req = 1`` moves them to another listener of the group.

``shared`` (the only mode where SO_REUSEPORT does not spread connections, e.g. macOS): the previous design,
one socket bound by uvicorn and inherited by every worker (``gare_serve.processes.uvicorn_config`` gives its
connections TCP_NODELAY). The per-worker sockets are made here with ``IPPROTO_TCP``, so asyncio gives their
accepted connections TCP_NODELAY itself.

A module of its own, at import level: the worker processes are spawned, so :func:`bind_worker_socket` (what a
pickled :class:`PortGroupSocket` becomes) must be importable by name.
"""

from __future__ import annotations

import os
import socket
import sys

from uvicorn.config import STARTUP_FAILURE  # the supervisor stops instead of restarting such a worker

__all__ = ["PortGroup", "PortGroupSocket", "REUSEPORT_SPREADS", "address_family", "bind_worker_socket",
           "resolve_worker_sockets"]

# SO_REUSEPORT spreads TCP connections over a port group on Linux (3.9+); elsewhere it means other things
# (macOS: the last socket bound gets them all; FreeBSD balances only with SO_REUSEPORT_LB)
REUSEPORT_SPREADS = sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")


def resolve_worker_sockets(mode: str) -> str:
    """``reuseport`` or ``shared`` for the ``worker_sockets`` setting (``auto``: reuseport where it spreads
    connections). ValueError for reuseport where it would not."""
    if mode == "auto":
        return "reuseport" if REUSEPORT_SPREADS else "shared"
    if mode == "reuseport" and not REUSEPORT_SPREADS:
        raise ValueError(f"worker_sockets=reuseport spreads connections on Linux only (this is {sys.platform}); "
                         "use shared")
    if mode not in ("reuseport", "shared"):
        raise ValueError(f"worker_sockets must be auto, reuseport or shared, got {mode!r}")
    return mode


def address_family(host: str) -> socket.AddressFamily:
    """uvicorn's rule (``Config.bind_socket``): IPv6 when the host has a colon."""
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def bind_worker_socket(family: int, host: str, port: int) -> socket.socket:
    """A worker's own listening socket in the port group (run in the worker when it unpickles its socket list;
    uvicorn listens on it once the app has started). ``IPPROTO_TCP``, so that asyncio gives every accepted
    connection TCP_NODELAY. A failure ends the worker with uvicorn's start-up failure status, which stops the
    supervisor instead of restarting the worker for ever."""
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        # logging is not configured yet in the worker (this runs while it unpickles its arguments)
        print(f"worker {os.getpid()}: cannot bind its socket to {host}:{port}: {e}", file=sys.stderr, flush=True)
        raise SystemExit(STARTUP_FAILURE) from None
    return sock


class PortGroupSocket(socket.socket):
    """The parent's anchor of a port group (see the module docstring): a real socket here, bound and never
    listening; pickled into a worker it is not duplicated but becomes that worker's own socket in the group
    (:func:`bind_worker_socket`)."""

    group_host: str = ""
    group_port: int = 0

    def __reduce__(self):  # type: ignore[override]
        return bind_worker_socket, (int(self.family), self.group_host, self.group_port)

    def __reduce_ex__(self, protocol):  # type: ignore[override]
        return self.__reduce__()


class PortGroup:
    """The port group of ``gare-serve --workers N`` with ``worker_sockets=reuseport``: binds ``host:port`` (OSError,
    EADDRINUSE when anything holds it) and keeps the anchor until :meth:`close`. ``port`` is the bound port (the
    one the kernel chose for port 0); ``socket`` goes in the supervisor's socket list."""

    def __init__(self, host: str, port: int) -> None:
        sock = PortGroupSocket(address_family(host), socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            # the ordinary bind first: EADDRINUSE if any socket listens on or holds the port (SO_REUSEPORT ones too)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            # then admit this user's SO_REUSEPORT sockets (the workers') and nothing else (see the module docstring)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
        except OSError:
            sock.close()
            raise
        self.host = host
        self.port: int = sock.getsockname()[1]
        sock.group_host, sock.group_port = host, self.port
        self.socket: PortGroupSocket = sock

    def close(self) -> None:
        self.socket.close()
