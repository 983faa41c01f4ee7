"""What the service checks before it loads anything: the checkpoint against the index manifest (sha256, memoised).

:func:`resolve_checkpoint` finds the checkpoint the served index names (or ``settings.checkpoint``) and refuses
one whose sha256 is not the one the index was built with; :class:`StartupError` carries a message meant for the
operator (``gare-serve`` prints it and exits 2; the lifespan logs it and fails the start).
"""

from __future__ import annotations

import logging
from pathlib import Path

from gare.checkpoint import file_sha256
from gare_index.store import (
    MANIFEST_FILE,
    VERSIONS_DIR,
    CheckpointRef,
    IndexFormatError,
    IndexManifest,
    current_version_name,
    read_manifest,
)
from gare_serve.settings import Settings

log = logging.getLogger(__name__)

__all__ = ["StartupError", "checkpoint_sha256", "resolve_checkpoint"]


class StartupError(RuntimeError):
    """The service cannot start with these settings (message is meant for the operator)."""


# (resolved path, size, mtime_ns) -> sha256: the CLI pre-check and the lifespan hash a large checkpoint once
_SHA_CACHE: dict[tuple[str, int, int], str] = {}


def checkpoint_sha256(path: Path) -> str:
    """sha256 of a file, memoised on (path, size, mtime) so the CLI pre-check and the lifespan hash once."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _SHA_CACHE:
        _SHA_CACHE[key] = file_sha256(path)
    return _SHA_CACHE[key]


def resolve_checkpoint(settings: Settings) -> tuple[Path, str, IndexManifest]:
    """(checkpoint path, its sha256, the current version's manifest); StartupError with a clear message."""
    if settings.index is None:
        raise StartupError("no index given: pass --index INDEX or set GARE_INDEX")
    root = Path(settings.index)
    if not root.is_dir():
        raise StartupError(f"index directory {root} does not exist")
    try:
        name = current_version_name(root)
        manifest = read_manifest(root / VERSIONS_DIR / name)
    except IndexFormatError as e:
        raise StartupError(f"cannot read the index: {e}") from None
    ck = manifest.checkpoint or CheckpointRef()
    want_sha = ck.sha256
    if settings.checkpoint is not None:
        path = Path(settings.checkpoint)
    elif ck.path:
        path = Path(ck.path)
        if not path.is_absolute():
            path = root / path
    else:
        raise StartupError(
            f"index {root} ({name}) names no checkpoint in {MANIFEST_FILE}; pass --checkpoint / GARE_CHECKPOINT"
        )
    if not path.is_file():
        hint = "" if settings.checkpoint is not None else " (the path recorded in the index manifest; pass --checkpoint if it moved)"
        raise StartupError(f"checkpoint {path} not found{hint}")
    sha = checkpoint_sha256(path)
    if want_sha is None:
        log.warning("index %s (%s) records no checkpoint sha256; serving with %s unverified", root, name, path)
    elif sha != want_sha:
        raise StartupError(
            f"checkpoint {path} has sha256 {sha}, but index {root} ({name}) was built with sha256 {want_sha}"
            f"{' (' + str(ck.path) + ')' if ck.path else ''}: refusing to serve scores from another model; "
            "pass the checkpoint the index was built with, or rebuild the index (gare-index build)"
        )
    return path, sha, manifest
