"""The index format's names, layout constants, errors, the directory lock and file helpers (shared by the
reader, the writer and verify; see the package docstring and docs/index-format.md).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from gare.atomic import atomic_write
from gare.psi_fold_videos import packed_width
from gare_index.frame_quant import FRAME_SCALES_ARRAY
from gare_index.ncl_ann import NCL_ANN_FILE
from gare_index.psi_consts import PSI_CONSTS_ARRAY
from gare_index.store.fast_hash import FastHasher

log = logging.getLogger(__name__)



FORMAT = "gare-index"
FORMAT_VERSION = 1

CURRENT_FILE = "CURRENT"
VERSIONS_DIR = "versions"
WORK_DIR = "work"
REPORT_FILE = "report.json"
MANIFEST_FILE = "manifest.json"
ANN_FILE = "ann.faiss"
ANN_NCL_FILE = NCL_ANN_FILE  # optional: stage 1 with the NCL biases folded in (--ncl-stage1)
META_FILE = "meta.sqlite"
LOCK_FILE = ".lock"

# name -> (dtype, number of dimensions); row count is n for all of them.
ARRAY_SPECS: dict[str, tuple[np.dtype, int]] = {
    "ids": (np.dtype(np.int64), 1),
    "norms": (np.dtype(np.float32), 1),
    "units": (np.dtype(np.float32), 2),
    "frames": (np.dtype(np.float16), 3),
    "masks": (np.dtype(np.uint8), 2),
    "biases": (np.dtype(np.float32), 1),
}
OPTIONAL_ARRAYS: dict[str, tuple[np.dtype, int]] = {
    "keys": (np.dtype(np.float16), 3),
    "values": (np.dtype(np.float16), 3),
    "ann_units": (np.dtype(np.float32), 2),  # InvGC-corrected stage-1 vectors (n, d)
    "psi_consts": (np.dtype(np.float32), 2),  # psi folded per video (n, 10f + 5f² + 2), gare.psi_fold
    FRAME_SCALES_ARRAY: (np.dtype(np.float32), 2),  # int8 frames' per-frame scales (n, f), gare_index.frame_quant
}
# frames.npy's dtype per manifest frame_dtype (int8 goes with frame_scales.npy)
FRAME_NP_DTYPES = {"float16": np.dtype(np.float16), "int8": np.dtype(np.int8)}
MMAP_ARRAYS = ("frames", "units", "keys", "values", "ann_units", "psi_consts", FRAME_SCALES_ARRAY)
ROW_DIM_ARRAYS = ("units", "ann_units")  # 2-D arrays of width d (the others are (n, f), psi_consts below)


def expected_shape(name: str, n: int, d: int, f: int) -> tuple[int, ...]:
    """The shape an array of the format must have for n videos of f frames of width d."""
    ndim = (ARRAY_SPECS.get(name) or OPTIONAL_ARRAYS[name])[1]
    if name == PSI_CONSTS_ARRAY:
        return (n, packed_width(f))
    return {1: (n,), 2: (n, d if name in ROW_DIM_ARRAYS else f), 3: (n, f, d)}[ndim]
META_COLUMNS: tuple[str, ...] = (
    "id", "path", "size", "mtime", "checksum", "duration", "fps", "frames_used", "start", "end", "status",
)
META_SQL_TYPES = {
    "id": "INTEGER PRIMARY KEY", "path": "TEXT NOT NULL", "size": "INT", "mtime": "REAL", "checksum": "TEXT",
    "duration": "REAL", "fps": "REAL", "frames_used": "INT", "start": "REAL", "end": "REAL", "status": "TEXT",
}
_VERSION_RE = re.compile(r"^v(\d{6,})$")
TMP_PREFIX = ".tmp-"



class IndexFormatError(Exception):
    """The directory is not a readable gare index (missing/corrupt file, unknown format version, ...)."""


class IndexMismatchError(IndexFormatError):
    """The index was built with another checkpoint than the one it is used with."""


def version_name(number: int) -> str:
    return f"v{int(number):06d}"


def version_number(name: str) -> int | None:
    m = _VERSION_RE.match(name)
    return int(m.group(1)) if m else None


# ------------------------------------------------------------------------------------------ test hook
def test_pause(stage: str) -> None:
    """Deterministic crash points for the kill tests (no effect unless GARE_INDEX_TEST_PAUSE names `stage`).

    ``GARE_INDEX_TEST_PAUSE=<stage>`` (comma-separated list allowed) makes the process, on reaching
    ``stage``, create the file named by ``GARE_INDEX_TEST_PAUSE_FILE`` (if set) and sleep for
    ``GARE_INDEX_TEST_PAUSE_SECONDS`` (default 3600) so that a test can SIGKILL it right there.
    Stages: ``encoded:<N>`` (after the work-cache batch that brings this run to >= N encoded clips is
    committed), ``write`` (a version's files are written into versions/.tmp-*, before the rename),
    ``switch`` (the version directory is in place, CURRENT not yet switched).
    """
    want = os.environ.get("GARE_INDEX_TEST_PAUSE")
    if not want or stage not in {s.strip() for s in want.split(",")}:
        return
    marker = os.environ.get("GARE_INDEX_TEST_PAUSE_FILE")
    if marker:
        Path(marker).write_text(f"{os.getpid()} {stage}\n")
    log.warning("GARE_INDEX_TEST_PAUSE: pausing at %s", stage)
    time.sleep(float(os.environ.get("GARE_INDEX_TEST_PAUSE_SECONDS", "3600")))


# ------------------------------------------------------------------------------------------ fs helpers
def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` atomically (gare.atomic.atomic_write: temp file, fsync, os.replace, fsync dir)."""
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


class HashingWriter:
    """File wrapper for np.save: hashes (sha256 and the fast hash) and counts what is written (numpy streams in
    ~16 MiB chunks)."""

    def __init__(self, fh: Any) -> None:
        self.fh = fh
        self.h = hashlib.sha256()
        self.fast = FastHasher()
        self.nbytes = 0

    def write(self, data: bytes | memoryview) -> int:
        self.h.update(data)
        self.fast.update(data)
        self.nbytes += len(data)
        return self.fh.write(data)

    def flush(self) -> None:
        self.fh.flush()


@contextlib.contextmanager
def index_lock(root: str | os.PathLike, name: str = LOCK_FILE, *, blocking: bool = True) -> Iterator[None]:
    """An exclusive flock on INDEX/<name> (released by the kernel if the process dies)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / name, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        flags = fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB)
        try:
            fcntl.flock(fd, flags)
        except BlockingIOError:
            raise IndexFormatError(f"{root}: another gare-index process is working on this index") from None
        yield
    finally:
        os.close(fd)
