"""Starting a Ray node for the GARE Serve application with every listener on one address, and gare-serve's HTTP
limits in Serve's proxy.

``python -m gare_serve.ray_serve.ray_node --node-address 10.0.0.1 --head`` (then ``--address 10.0.0.1:6379`` on
every other host) runs ``ray start`` with :func:`ray_start_args` and :func:`ray_env`:

- ``--node-ip-address A``: Ray's core listeners (GCS, raylet, object manager, workers, the dashboard agent, the
  metrics export port, the runtime-env agent, the Ray client server) bind it. Ray's CLI rewrites a loopback
  address to the host's routable one (``ray._private.services.resolve_ip_for_localhost``) unless
  ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, which :func:`ray_env` sets for a loopback ``A`` (a one-host cluster).
- the dashboard off, or on ``A`` (``--dashboard-host``); it accepts Ray jobs, so it must not face clients.
- ``RAY_SERVE_DEFAULT_HTTP_HOST=A``: Serve's proxy binds ``A`` unless ``serve start --http-host`` says otherwise.
- ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``: gare-serve's header and body timeouts, body limits and Host check
  in Serve's proxy (``gare_serve.ray_serve.proxy_limits``), from the ``GARE_*`` settings of the node's environment.

One listener no Ray option reaches: every Serve replica opens an inter-deployment gRPC server on ``[::]:0``
(``ray.serve._private.replica``). :func:`bind_replica_grpc_to_node_address`, called by the project's
deployments in their constructors (which Ray runs before it starts that server), binds it to the replica's
node address instead. ``tests/serve_ray/test_ray_limits.py`` lists every socket a cluster opened and fails on a
listener off the node address.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.serve._private import replica as serve_replica

from gare_serve.ray_serve.proxy_limits import CALLBACK_ENV, CALLBACK_PATH

log = logging.getLogger(__name__)

__all__ = ["bind_replica_grpc_to_node_address", "is_loopback", "main", "ray_env", "ray_start_args",
           "serve_http_options"]

WILDCARD_HOSTS = ("[::]", "0.0.0.0", "::", "")  # how Ray spells "every interface" in a gRPC bind address


def is_loopback(address: str) -> bool:
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False


def check_node_address(address: str) -> str:
    """A node address is one IP address of this host, never a wildcard (ValueError naming it otherwise)."""
    try:
        ip = ipaddress.ip_address(address.strip("[]"))
    except ValueError:
        raise ValueError(f"node address must be an IP address of this host, got {address!r}") from None
    if ip.is_unspecified:
        raise ValueError(f"node address must be one address, not every interface ({address!r})")
    return str(ip)


def ray_env(node_address: str) -> dict[str, str]:
    """The environment of ``ray start`` (every Ray process of the node inherits it), on top of the ``GARE_*``
    settings: see the module docstring."""
    address = check_node_address(node_address)
    env = {CALLBACK_ENV: CALLBACK_PATH, "RAY_SERVE_DEFAULT_HTTP_HOST": address, "RAY_USAGE_STATS_ENABLED": "0"}
    if is_loopback(address):
        env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # else Ray's CLI replaces 127.0.0.1 with the host's address
    return env


def ray_start_args(node_address: str, *, head: bool, address: str | None = None, port: int = 6379,
                   dashboard: bool = False, block: bool = False) -> list[str]:
    """``ray start`` arguments: the head (``head=True``, GCS on ``port``) or a node joining ``address``."""
    node = check_node_address(node_address)
    if head == bool(address):
        raise ValueError(f"give either head=True or the head's address, got head={head} address={address!r}")
    args = ["ray", "start", f"--node-ip-address={node}", "--disable-usage-stats"]
    if head:
        args += ["--head", f"--port={int(port)}"]
        args += [f"--dashboard-host={node}"] if dashboard else ["--include-dashboard=false"]
    else:
        args += [f"--address={address}"]
    return args + (["--block"] if block else [])


def serve_http_options(node_address: str, port: int = 8000) -> dict[str, Any]:
    """``serve.start(http_options=...)`` for a proxy on the node address (``serve start --http-host``)."""
    return {"host": check_node_address(node_address), "port": int(port)}


def _node_bound(add_port: Callable[[Any, str], int], host: str) -> Callable[[Any, str], int]:
    def add_port_on_node(server: Any, address: str) -> int:
        bind_host, sep, port = address.rpartition(":")
        if sep and bind_host in WILDCARD_HOSTS:
            address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return add_port(server, address)

    add_port_on_node.gare_node_bound = True  # type: ignore[attr-defined]
    return add_port_on_node


def bind_replica_grpc_to_node_address() -> bool:
    """In a Serve replica's process: its inter-deployment gRPC server (Ray binds it to ``[::]:0``) binds the
    node's address instead. Call it from the deployment's constructor. False (and a warning) when this Ray has no
    such server to rebind; a no-op outside a Ray worker."""
    if not ray.is_initialized():
        return False
    add_port = getattr(serve_replica, "add_port_to_grpc_server", None)
    if add_port is None:
        log.warning("ray %s: no ray.serve._private.replica.add_port_to_grpc_server; the replica's gRPC server "
                    "keeps Ray's bind address", ray.__version__)
        return False
    if not getattr(add_port, "gare_node_bound", False):
        host = ray.util.get_node_ip_address()
        serve_replica.add_port_to_grpc_server = _node_bound(add_port, host)
        log.info("Serve replica gRPC server bound to the node address %s", host)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gare_serve.ray_serve.ray_node", description=__doc__.split("\n")[0])
    p.add_argument("--node-address", required=True, help="this host's address every Ray listener binds")
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument("--head", action="store_true", help="start the head node")
    who.add_argument("--address", help="the head's GCS address (HOST:6379) to join")
    p.add_argument("--port", type=int, default=6379, help="the head's GCS port")
    p.add_argument("--dashboard", action="store_true", help="start the dashboard, on the node address")
    p.add_argument("--block", action="store_true", help="stay in the foreground (containers)")
    p.add_argument("--dry-run", action="store_true", help="print the environment and the command, start nothing")
    a = p.parse_args(argv)
    try:
        args = ray_start_args(a.node_address, head=a.head, address=a.address, port=a.port, dashboard=a.dashboard,
                              block=a.block)
        env = ray_env(a.node_address)
    except ValueError as e:
        p.error(str(e))
    if a.dry_run:
        print(" ".join([*(f"{k}={v}" for k, v in sorted(env.items())), *args]))
        return 0
    ray_bin = shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray") or "ray"
    os.execvpe(ray_bin, [ray_bin, *args[1:]], {**os.environ, **env})
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
