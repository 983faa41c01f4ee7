"""What the service checks before it loads anything: the checkpoint against the index manifest (sha256, memoised),
and the warm-up of the hot part of a version it loads (:func:`warm_index`, bounded by ``warm_index_bytes``).

:func:`resolve_checkpoint` finds the checkpoint the served index names (or ``settings.checkpoint``) and refuses
one whose sha256 is not the one the index was built with; :class:`StartupError` carries a message meant for the
operator (``gare-serve`` prints it and exits 2; the lifespan logs it and fails the start).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from gare.checkpoint import file_sha256
from gare_index.store import (
    ANN_FILE,
    ANN_NCL_FILE,
    MANIFEST_FILE,
    VERSIONS_DIR,
    CheckpointRef,
    IndexFormatError,
    IndexManifest,
    IndexVersion,
    current_version_name,
    read_manifest,
)
from gare_serve.settings import Settings

log = logging.getLogger(__name__)

__all__ = ["WARM_ORDER", "StartupError", "checkpoint_sha256", "resolve_checkpoint", "warm_index"]


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


# What a first search reads, hottest first: stage 1 reads the whole ANN index (and, for ivfpq / flat, the
# vectors it re-scores), the rerank the constants, v̄ rows and frames of only K candidates per query.
WARM_ORDER = (ANN_FILE, ANN_NCL_FILE, "ann_units.npy", "units.npy", "norms.npy", "biases.npy", "psi_consts.npy",
              "frame_scales.npy", "frames.npy")  # frame_scales: an int8-frames index (gare_index.frame_quant)


def warm_index(version: IndexVersion, budget_bytes: int) -> dict[str, int]:
    """Ask the kernel to read the hot part of `version` into the page cache now, at load (start or reload), so
    the first searches do not pay a disk read per page: the files of WARM_ORDER in that order, each from its
    start, at most `budget_bytes` in all (posix_fadvise WILLNEED: the reads run in the background; nothing is
    locked, the page cache may still evict). Returns the bytes asked for per file (0 budget: nothing)."""
    if budget_bytes < 0:
        raise ValueError(f"warm_index budget_bytes must be >= 0, got {budget_bytes}")
    left = budget_bytes
    done: dict[str, int] = {}
    for name in WARM_ORDER:
        path = Path(version.path) / name
        if left <= 0 or not path.is_file():
            continue
        size = path.stat().st_size
        take = min(size, left)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:  # pragma: no cover - the version was opened a moment ago
            log.warning("warm-up: cannot open %s: %s", path, e)
            continue
        try:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, take, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)
        done[name] = take
        left -= take
    log.info("warm-up of index version %s: %.1f MB of %s asked into the page cache (budget %.1f MB)",
             getattr(version, "name", "?"), (budget_bytes - left) / 2**20, ", ".join(done) or "nothing",
             budget_bytes / 2**20)
    return done
