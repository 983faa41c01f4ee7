"""``gare-serve``: run the search service with uvicorn.

    gare-serve --index INDEX [--checkpoint CKPT] [--config FILE] [--host 127.0.0.1] [--port 8000] [--workers N] ...
    gare-serve --index INDEX --check          # verify settings, checkpoint hash and index, then exit
    echo -n KEY | gare-serve --hash-key       # print sha256:<hex> for a keys file

Settings come from (lowest to highest priority) defaults, the ``--config`` file (YAML/JSON), ``GARE_*``
environment variables and the options below. Exit status 2 means bad settings (message on stderr).

Workers. ``--workers N`` (default: the usable cores, ``os.sched_getaffinity``) runs N processes behind the
port with uvicorn's own process manager (``uvicorn.supervisors.Multiprocess``, what ``uvicorn.run(...,
factory=True, workers=N)`` runs; a supervisor that restarts a worker that dies, no extra dependency). How they
listen (``--worker-sockets``, ``gare_serve.processes.port_group``): ``reuseport`` (default on Linux) gives every worker a
listening socket of its own on the port (SO_REUSEPORT), so the kernel spreads connections evenly over the
workers whatever the clients do; the port is bound here first (an address in use fails the start at once;
port 0 picks one port for all) and held for the life of the group. ``shared``: one listening socket opened
here and inherited by every worker (the first worker awake takes all queued connections: a burst of
keep-alive clients can all land on one worker). Either way connections keep TCP_NODELAY (on uvicorn's own
socket Nagle's algorithm holds every keep-alive response until the client's delayed ACK;
``gare_serve.processes.uvicorn_config.NodelayConfig``).
(gunicorn + uvicorn workers would give the same model, but one more package and config surface, and
uvicorn's supervisor already restarts workers.) Each worker builds the app with ``gare_serve.app.create_app``
from the resolved settings, exported here as ``GARE_*`` variables, and bounds its torch and FAISS threads
to ``usable cores // N`` (at least 1) unless ``--torch-threads`` says otherwise, so N workers never fight
over the cores. The workers share a run directory (reload generation, per-worker state for readiness;
``gare_serve.engine.worker_board``) and a Prometheus multiprocess directory, both emptied at start.
``--workers 1`` serves in this process, as before.

One engine per device. With ``--engine shared`` (``auto``, the default, chooses it on CUDA with several workers)
the workers load neither the model nor the index's vectors: one engine process does, on the device, and searches
for all of them, its micro-batches holding the queries of every worker (``gare_serve.processes.engine_process``,
``gare_serve.engine.engine_server``). It gets every usable core (``--torch-threads`` otherwise), the workers one
thread each; the supervisor restarts it when it dies (the workers answer 503 meanwhile) and stops it last.

Slow clients and shutdown. Both paths serve with ``gare_serve.web.http_limits.HeaderTimeoutH11Protocol`` (a request's
headers within ``--header-timeout-s``; the body bound is the app's ``BodyTimeoutMiddleware``). SIGTERM or
SIGINT stops accepting and drains the requests in flight (``GRACEFUL_SHUTDOWN_S``); with workers the
supervisor forwards SIGTERM to each and exits only after all of them, and a worker whose supervisor is killed
gets SIGTERM from the kernel (``gare_serve.processes.worker_lifetime``).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import uvicorn
import uvicorn.supervisors

from gare.cli_logging import setup_cli_logging
from gare_serve.app import create_app
from gare_serve.engine.prometheus import Metrics
from gare_serve.engine.startup import StartupError, resolve_checkpoint
from gare_serve.engine.state import ServiceState
from gare_serve.engine.worker_board import usable_cores
from gare_serve.processes.engine_process import EngineProcess, keep_engine, resolve_engine
from gare_serve.processes.port_group import PortGroup, resolve_worker_sockets
from gare_serve.processes.uvicorn_config import NodelayConfig
from gare_serve.processes.worker_lifetime import prompt_supervisor
from gare_serve.settings import Settings, SettingsError, hash_key, load_settings
from gare_serve.web.http_limits import LimitsConfig

log = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 10  # uvicorn's timeout_graceful_shutdown: requests in flight at SIGTERM get this long


def _bool(v: str) -> bool:
    t = v.strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {v!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gare-serve",
        description="Serve a GARE index over HTTP (REST API under /v1, web page at /, OpenAPI at /docs).",
        epilog="Every option can also be set as GARE_<NAME> in the environment or in the --config file.",
    )
    p.add_argument("--config", help="YAML or JSON file of settings (GARE_CONFIG)")
    p.add_argument("--index", help="index directory (holds CURRENT)")
    p.add_argument("--checkpoint", help="checkpoint file (default: the one the index manifest names; sha256 must match)")
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8000; 0 = any free port)")
    p.add_argument("--device", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16"], help="text encoder precision")
    p.add_argument("--torch-threads", type=int, help="torch/FAISS threads per worker (default: usable cores // workers)")
    p.add_argument("--workers", type=int, help="worker processes (default: the usable cores; 1 = serve in this process)")
    p.add_argument("--engine", choices=["auto", "in_process", "shared"],
                   help="shared = one engine process loads the model and index on the device and searches for every "
                        "worker (batches across them); in_process = each worker loads its own; auto (default) = "
                        "shared on CUDA with several workers")
    p.add_argument("--worker-sockets", choices=["auto", "reuseport", "shared"],
                   help="with --workers N: reuseport = a listening socket per worker (SO_REUSEPORT: the kernel spreads "
                        "connections evenly), shared = one socket for all; auto (default) = reuseport on Linux")
    p.add_argument("--text-encoder", choices=["auto", "fp32", "int8", "fp32-packed", "fp16"],
                   help="query text tower (int8 and fp32-packed are CPU options, fp16 the CUDA one; "
                        "fp32 = the model's own at --precision; default auto: the measured default of the device at fp32)")
    p.add_argument("--rerank-device", choices=["model", "cpu"],
                   help="where the psi rerank runs when the model is on a GPU: model (default) = there, cpu = the "
                        "compiled CPU kernel over the memory-mapped index")
    p.add_argument("--query-cache-entries", type=int, help="query embedding cache size (0 = off)")
    p.add_argument("--result-cache-entries", type=int, help="search result cache size (0 = off)")
    p.add_argument("--library-root", help="show video paths relative to this folder; files outside it are not served")
    p.add_argument("--cors-origins", help="comma-separated allowed origins (default: none, CORS closed)")
    p.add_argument("--require-key-for-search", type=_bool, nargs="?", const=True,
                   help="search routes need a key too (a search or an admin key)")
    p.add_argument("--search-keys-file", help="file with one search key (or sha256:<hex>) a line: search routes only")
    p.add_argument("--admin-keys-file", help="file with one admin key (or sha256:<hex>) a line: admin routes and search")
    p.add_argument("--api-keys-file", help="deprecated (its keys are admin keys): use --admin-keys-file")
    p.add_argument("--verify-index", type=_bool, nargs="?", const=True, help="re-hash index files on open")
    p.add_argument("--batch-max-size", type=int, help="micro-batch size limit")
    p.add_argument("--batch-max-wait-ms", type=float, help="micro-batch wait for company")
    p.add_argument("--header-timeout-s", type=float,
                   help="a request's headers must arrive within this of the connection opening or the previous "
                        "response (default 10; 408 or close beyond)")
    p.add_argument("--body-timeout-s", type=float, help="a request body must arrive within this (default 30; 408 beyond)")
    p.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--check", action="store_true", help="check settings, checkpoint hash and index, then exit")
    p.add_argument("--hash-key", action="store_true", help="read an API key on stdin, print sha256:<hex> (for a keys file), exit")
    return p


def settings_from_args(args: argparse.Namespace) -> Settings:
    names = [
        "index", "checkpoint", "host", "port", "device", "precision", "torch_threads", "library_root",
        "cors_origins", "require_key_for_search", "api_keys_file", "search_keys_file", "admin_keys_file", "verify_index",
        "batch_max_size", "batch_max_wait_ms", "log_level", "workers", "text_encoder", "query_cache_entries", "result_cache_entries",
        "header_timeout_s", "body_timeout_s", "worker_sockets", "rerank_device", "engine",
    ]
    overrides: dict[str, Any] = {n: getattr(args, n) for n in names}
    return load_settings(args.config, **overrides)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.hash_key:
        key = sys.stdin.read().strip()
        if not key:
            print("gare-serve: no key on stdin", file=sys.stderr)
            return 2
        print(f"sha256:{hash_key(key)}")
        return 0
    try:
        settings = settings_from_args(args)
    except SettingsError as e:
        print(f"gare-serve: {e}", file=sys.stderr)
        return 2
    # Our loggers at --log-level; third-party libraries (open_clip's root-logger lines) only at debug.
    setup_cli_logging(settings.log_level == "debug", level=settings.log_level)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Several workers with a socket each: take the port first, so that an address in use fails in a moment,
    # not after the checks below.
    group = None
    if not args.check:
        workers = settings.workers or usable_cores()
        try:
            engine = resolve_engine(settings.engine, settings.device, workers)
        except (ValueError, RuntimeError) as e:
            print(f"gare-serve: {e}", file=sys.stderr)
            return 2
        settings = settings.model_copy(update={"engine": engine})
        if workers > 1 or engine == "shared":
            group, status = open_port_group(settings)
            if status:
                return status
    try:
        return _serve(args, settings, group)
    finally:
        if group is not None:
            group.close()


def _serve(args: argparse.Namespace, settings: Settings, group: Any) -> int:
    try:
        # Fail fast with a clear message (the lifespan checks again; the hash is memoised).
        path, sha, manifest = resolve_checkpoint(settings)
        app = create_app(settings)
    except (StartupError, SettingsError) as e:
        print(f"gare-serve: {e}", file=sys.stderr)
        return 2
    if args.check:
        # Do what the lifespan will do: load the model and open (and, with --verify-index, re-hash) the index.
        state = ServiceState(settings, Metrics())
        try:
            state.load()
        except StartupError as e:
            print(f"gare-serve: {e}", file=sys.stderr)
            return 2
        finally:
            state.close()
        print(f"ok: index {settings.index} ({manifest.n} entries), checkpoint {path} sha256 {sha}")
        return 0

    workers = settings.workers or usable_cores()
    if settings.engine == "shared":
        # the engine computes for everyone: every usable core unless told; the workers render and wait
        engine_threads = settings.torch_threads or usable_cores()
        settings = settings.model_copy(update={"torch_threads": settings.torch_threads or 1})
        return serve_workers(settings, workers, group, engine_threads=engine_threads)
    if settings.torch_threads is None:
        settings = settings.model_copy(update={"torch_threads": max(1, usable_cores() // workers)})
    if workers > 1:
        return serve_workers(settings, workers, group)
    app = create_app(settings)
    # SIGTERM/SIGINT: stop accepting, drain the requests in flight (at most GRACEFUL_SHUTDOWN_S), then exit
    config = LimitsConfig(
        app, host=settings.host, port=settings.port, log_level=settings.log_level, proxy_headers=False,
        server_header=False, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, header_timeout_s=settings.header_timeout_s,
        send_timeout_s=settings.send_timeout_s, send_buffer_bytes=settings.send_buffer_bytes,
    )
    server = uvicorn.Server(config)
    try:
        server.run()
    except KeyboardInterrupt:  # pragma: no cover
        pass
    if not server.started:
        print("gare-serve: the service did not start (see the error above)", file=sys.stderr)
        return 1
    return 0


def _env_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def worker_environment(settings: Settings, workers: int, run_dir: Path, prom_dir: Path) -> dict[str, str]:
    """The GARE_* variables that make every worker's ``load_settings()`` equal ``settings`` (plus the run dirs)."""
    env = {f"GARE_{name.upper()}": _env_value(v) for name, v in settings.model_dump().items() if v is not None}
    env["GARE_WORKERS"] = str(workers)
    env["GARE_RUN_DIR"] = str(run_dir)
    env["PROMETHEUS_MULTIPROC_DIR"] = str(prom_dir)
    return env


def _empty_dir(d: Path) -> None:
    d.mkdir(parents=True, exist_ok=True)
    for p in d.iterdir():
        if p.is_file() and p.suffix == ".db":  # only prometheus_client's files: never someone else's
            p.unlink()


def _stop_workers(supervisor: Any) -> None:
    """Workers still running once the supervisor returned (it raised, or was interrupted before it joined
    them): SIGTERM, a graceful drain, then SIGKILL, so that this process never exits before its workers."""
    procs = [p.process for p in getattr(supervisor, "processes", []) if p.process.is_alive()]
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.join(GRACEFUL_SHUTDOWN_S + 5)
        if proc.is_alive():  # pragma: no cover - a worker stuck past its graceful shutdown
            proc.kill()
            proc.join()


def open_port_group(settings: Settings) -> tuple[Any, int]:
    """(the bound port group, 0) when the workers listen on a socket each (``worker_sockets``), (None, 0) when
    they share one; (None, exit status) with a message on stderr when the setting cannot be honoured here (2)
    or the address is in use (1)."""
    try:
        mode = resolve_worker_sockets(settings.worker_sockets)
    except ValueError as e:
        print(f"gare-serve: {e}", file=sys.stderr)
        return None, 2
    if mode != "reuseport":
        return None, 0
    try:
        return PortGroup(settings.host, settings.port), 0
    except OSError as e:
        print(f"gare-serve: cannot listen on {settings.host}:{settings.port}: {e.strerror or e}", file=sys.stderr)
        return None, 1


def serve_workers(settings: Settings, workers: int, group: Any = None, engine_threads: int | None = None) -> int:
    """Run ``workers`` uvicorn worker processes behind one port (see the module docstring); ``group``: the port
    group ``main`` already bound (:func:`open_port_group`), closed here when the workers are done. With
    ``settings.engine`` shared, one engine process (``engine_threads`` torch threads) searches for all of them
    (``gare_serve.processes.engine_process``)."""
    if group is None:
        group, status = open_port_group(settings)  # None again with worker_sockets=shared
        if status:
            return status
    mode = "shared" if group is None else "reuseport"
    if group is not None:
        settings = settings.model_copy(update={"port": group.port})  # port 0: the one chosen, for every worker
    run_dir = Path(tempfile.mkdtemp(prefix="gare-serve-"))
    given = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    prom_dir = Path(given) if given else run_dir / "prometheus"
    _empty_dir(prom_dir)  # stale series of an earlier run would be summed in
    os.environ.pop("GARE_CONFIG", None)  # the exported values already include the file's
    os.environ.update(worker_environment(settings, workers, run_dir, prom_dir))
    log.info(
        "starting %d workers, %d torch threads each, %s listening socket%s (run dir %s)%s", workers,
        settings.torch_threads, "a" if mode == "reuseport" else "one shared", " each" if mode == "reuseport" else "",
        run_dir, f", and one search engine ({engine_threads} torch threads)" if settings.engine == "shared" else "",
    )
    supervisor = None
    engine = None
    if settings.engine == "shared":
        try:
            engine = EngineProcess(settings, run_dir, engine_threads, workers)
        except ValueError as e:  # the run directory's path cannot hold the engine's socket
            print(f"gare-serve: {e}", file=sys.stderr)
            shutil.rmtree(run_dir, ignore_errors=True)
            return 2
    try:
        # what uvicorn.run(..., workers=N) does, with listening sockets that keep TCP_NODELAY, the header
        # timeout, and workers that die with this process (gare_serve.processes.uvicorn_config)
        config = NodelayConfig(
            "gare_serve.app:create_app", factory=True, workers=workers, host=settings.host, port=settings.port,
            log_level=settings.log_level, proxy_headers=False, server_header=False,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, header_timeout_s=settings.header_timeout_s,
            send_timeout_s=settings.send_timeout_s, send_buffer_bytes=settings.send_buffer_bytes,
            # uvicorn pings each worker and kills one that does not answer in time (default 5 s): importing
            # torch and loading a model on a busy machine holds the GIL longer than that
            timeout_worker_healthcheck=settings.worker_healthcheck_s,
        )
        if group is not None:
            # the group's anchor: each worker it is pickled into binds its own socket in the group (gare_serve.processes.port_group)
            sockets = [group.socket]
            fmt = "%s://[%s]:%d" if ":" in settings.host else "%s://%s:%d"
            logging.getLogger("uvicorn.error").info(  # the line uvicorn's bind_socket logs for the shared socket
                f"Uvicorn running on {fmt} (Press CTRL+C to quit)", "http", settings.host, group.port)
        else:
            sockets = [config.bind_socket()]
        base = prompt_supervisor(uvicorn.supervisors.Multiprocess)
        supervisor = (base if engine is None else keep_engine(base, engine))(config, sockets=sockets)
        # On SIGTERM/SIGINT the supervisor sends SIGTERM to every worker and joins them all (each drains its
        # requests for at most GRACEFUL_SHUTDOWN_S): this process exits after its workers.
        supervisor.run()
    except KeyboardInterrupt:  # pragma: no cover
        pass
    finally:
        if supervisor is not None:
            _stop_workers(supervisor)
        if engine is not None:
            engine.stop()
        if group is not None:
            group.close()
        shutil.rmtree(run_dir, ignore_errors=True)
        if given:
            _empty_dir(prom_dir)
    if engine is not None and engine.failed_to_start:
        print("gare-serve: the search engine did not start (see the error above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
