"""The shared engine's wire: where it listens, how a connection proves it knows the key, and how messages travel.

``gare-serve --workers N`` with ``engine=shared`` runs one engine process (``gare_serve.engine.engine_server``) that
holds the model, the query encoder and the index version on the device; the HTTP workers reach it over a Unix
socket in the run directory (:func:`engine_address`, never a TCP port). Both ends read a random key the supervisor
wrote next to it (:func:`read_engine_key`, mode 0600 in the 0700 run directory) and prove it to each other before
anything is unpickled: each side sends a 32-byte challenge and checks the other's HMAC-SHA256 of it
(:func:`prove_and_check`, the way ``multiprocessing.connection`` authenticates).

A message is an 8-byte big-endian length and a pickle: a request ``(request id, op, args)`` and its answer
``(request id, ok, value or exception)``; answers may come back in any order (one connection carries every
request of a worker at once).

:class:`EngineUnavailable` is what a worker raises when the engine cannot answer (the app answers 503 with its
message); :class:`EngineVersionGone` when the engine no longer holds the index version the request started on.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import pickle
import secrets
import struct
from pathlib import Path
from typing import Any

__all__ = ["ENGINE_KEY_FILE", "ENGINE_READY_FILE", "ENGINE_SOCKET", "EngineUnavailable", "EngineVersionGone",
           "engine_address", "engine_ready_pid", "mark_engine_ready", "portable_error", "prove_and_check",
           "read_engine_key", "read_message", "write_engine_key", "write_message"]

ENGINE_SOCKET = "engine.sock"
ENGINE_KEY_FILE = "engine.key"
ENGINE_READY_FILE = "engine.ready"  # the pid of the engine that has loaded and listens on the socket
_HEADER = struct.Struct("!Q")
MAX_MESSAGE_BYTES = 1 << 30  # a result set or an image is far below; a corrupt length must not allocate it
_CHALLENGE_BYTES = 32
UNIX_PATH_MAX = 107  # sun_path holds 108 bytes with the terminating NUL (Linux)


class EngineUnavailable(RuntimeError):
    """The shared engine cannot answer now (not started yet, restarting, stopped, or not answering in time)."""


class EngineVersionGone(EngineUnavailable):
    """The engine no longer holds the index version a request started on (it switched versions since)."""


def engine_address(run_dir: str | os.PathLike) -> Path:
    """The engine's Unix socket in ``run_dir`` (ValueError when the path is too long for a Unix socket)."""
    path = Path(run_dir) / ENGINE_SOCKET
    if len(os.fsencode(path)) > UNIX_PATH_MAX:
        raise ValueError(f"the engine socket path {path} is longer than {UNIX_PATH_MAX} bytes (a Unix socket's "
                         "limit); set TMPDIR to a shorter directory")
    return path


def write_engine_key(run_dir: str | os.PathLike) -> bytes:
    """A new random key, written to ``run_dir``/engine.key readable by this user only."""
    key = secrets.token_bytes(32)
    path = Path(run_dir) / ENGINE_KEY_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(key)
    return key


def read_engine_key(run_dir: str | os.PathLike) -> bytes:
    """The key :func:`write_engine_key` wrote (OSError when it is not there)."""
    return (Path(run_dir) / ENGINE_KEY_FILE).read_bytes()


def mark_engine_ready(run_dir: str | os.PathLike) -> None:
    """Record that this process has loaded and listens (temp name then ``os.replace``: never half written)."""
    path = Path(run_dir) / ENGINE_READY_FILE
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(str(os.getpid()))
    os.replace(tmp, path)


def engine_ready_pid(run_dir: str | os.PathLike) -> int | None:
    """The pid :func:`mark_engine_ready` wrote last, or None when no engine has been ready yet."""
    try:
        return int((Path(run_dir) / ENGINE_READY_FILE).read_text())
    except (OSError, ValueError):
        return None


async def _read_raw(reader: asyncio.StreamReader, limit: int) -> bytes:
    (n,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    if n > limit:
        raise ConnectionError(f"engine wire: a message of {n} bytes exceeds the limit of {limit}")
    return await reader.readexactly(n)


def _frame(data: bytes) -> bytes:
    return _HEADER.pack(len(data)) + data


async def prove_and_check(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: bytes) -> None:
    """Mutual authentication: send a challenge, answer the peer's, check the peer's answer to ours
    (ConnectionError when it is wrong). Both ends run the same steps, so neither waits on the other."""
    mine = secrets.token_bytes(_CHALLENGE_BYTES)
    writer.write(_frame(mine))
    await writer.drain()
    theirs = await _read_raw(reader, _CHALLENGE_BYTES)
    writer.write(_frame(hmac.new(key, theirs, hashlib.sha256).digest()))
    await writer.drain()
    answer = await _read_raw(reader, hashlib.sha256().digest_size)
    if not hmac.compare_digest(answer, hmac.new(key, mine, hashlib.sha256).digest()):
        raise ConnectionError("engine wire: the peer does not know the engine key")


async def read_message(reader: asyncio.StreamReader) -> Any:
    """The next message (asyncio.IncompleteReadError at the end of the stream)."""
    return pickle.loads(await _read_raw(reader, MAX_MESSAGE_BYTES))


def write_message(writer: asyncio.StreamWriter, message: Any) -> None:
    """Queue ``message`` on ``writer`` (the caller drains)."""
    writer.write(_frame(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)))


def portable_error(e: BaseException) -> BaseException:
    """``e`` itself when it survives a pickle round trip (the worker then raises the same type, mapped to the same
    HTTP status as in process), else a RuntimeError naming its type and message."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - any failure to pickle or rebuild
        return RuntimeError(f"{type(e).__name__}: {e}")
