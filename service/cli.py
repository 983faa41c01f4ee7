"""``gare-serve``: run the search service with uvicorn.

    gare-serve --index INDEX [--checkpoint CKPT] [--config FILE] [--host 127.0.0.1] [--port 8000] ...
    gare-serve --index INDEX --check          # verify settings, checkpoint hash and index, then exit
    echo -n KEY | gare-serve --hash-key       # print sha256:<hex> for a keys file

Settings come from (lowest to highest priority) defaults, the ``--config`` file (YAML/JSON), ``GARE_*``
environment variables and the options below. Exit status 2 means bad settings (message on stderr).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from training.cli_logging import setup_cli_logging

from .settings import Settings, SettingsError, hash_key, load_settings


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
    p.add_argument("--rerank-impl", choices=["fused", "model"], help="psi rerank implementation (same scores)")
    p.add_argument("--torch-threads", type=int, help="torch intra-op threads")
    p.add_argument("--library-root", help="show video paths relative to this folder; files outside it are not served")
    p.add_argument("--cors-origins", help="comma-separated allowed origins (default: none, CORS closed)")
    p.add_argument("--require-key-for-search", type=_bool, nargs="?", const=True, help="search routes need an API key too")
    p.add_argument("--api-keys-file", help="file with one API key (or sha256:<hex>) a line")
    p.add_argument("--verify-index", type=_bool, nargs="?", const=True, help="re-hash index files on open")
    p.add_argument("--batch-max-size", type=int, help="micro-batch size limit")
    p.add_argument("--batch-max-wait-ms", type=float, help="micro-batch wait for company")
    p.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--check", action="store_true", help="check settings, checkpoint hash and index, then exit")
    p.add_argument("--hash-key", action="store_true", help="read an API key on stdin, print sha256:<hex>, exit")
    return p


def settings_from_args(args: argparse.Namespace) -> Settings:
    names = [
        "index", "checkpoint", "host", "port", "device", "precision", "rerank_impl", "torch_threads", "library_root",
        "cors_origins", "require_key_for_search", "api_keys_file", "verify_index", "batch_max_size",
        "batch_max_wait_ms", "log_level",
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

    from .app import StartupError, create_app, resolve_checkpoint

    try:
        # Fail fast with a clear message (the lifespan checks again; the hash is memoised).
        path, sha, manifest = resolve_checkpoint(settings)
        app = create_app(settings)
    except (StartupError, SettingsError) as e:
        print(f"gare-serve: {e}", file=sys.stderr)
        return 2
    if args.check:
        # Do what the lifespan will do: load the model and open (and, with --verify-index, re-hash) the index.
        from .app import ServiceState
        from .metrics import Metrics

        state = ServiceState(settings, Metrics())
        try:
            state.load()
        except StartupError as e:
            print(f"gare-serve: {e}", file=sys.stderr)
            return 2
        finally:
            state.close()
        print(f"ok: index {settings.index} ({manifest.get('n')} entries), checkpoint {path} sha256 {sha}")
        return 0

    import uvicorn

    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, log_level=settings.log_level, proxy_headers=False,
        server_header=False, timeout_graceful_shutdown=10,
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


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
