"""The index writers' .npy staging: memory maps whose space is reserved up front, and files to link in.

:class:`ExistingFile` (an array already on disk) lives here, below :mod:`gare_index.store` and
:mod:`gare_index.psi_consts`, so that both can name it without importing each other.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["ExistingFile", "alloc_npy"]


@dataclass(frozen=True)
class ExistingFile:
    """An array already on disk (a staged .npy, or a file of a previous version) to link into a version.

    `sha256` may be given when known (files of an immutable previous version) to skip re-hashing; so may
    `fast_hash` (the manifest's ``fast_hash``; when absent the writer takes it from the manifest next to `path`
    when that one records the same sha256, else hashes the file).
    """

    path: Path
    sha256: str | None = None
    fast_hash: str | None = None


def alloc_npy(path: Path, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
    """A writable memmap of a new .npy file whose data blocks are reserved up front (posix_fallocate).

    Writing into a sparse memory map on a full disk kills the process with SIGBUS; reserving the space
    first turns that into an ordinary OSError (ENOSPC) before anything is written.
    """
    dtype = np.dtype(dtype)
    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": tuple(int(x) for x in shape)}
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    with open(path, "wb") as fh:
        np.lib.format.write_array_header_2_0(fh, header)
        offset = fh.tell()
        if nbytes:
            try:
                os.posix_fallocate(fh.fileno(), offset, nbytes)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                fh.seek(offset)  # no fallocate on this filesystem: write the zeros ourselves
                zeros = bytes(1 << 20)
                left = nbytes
                while left:
                    left -= fh.write(zeros[: min(left, len(zeros))])
    if nbytes == 0:
        return np.zeros(shape, dtype=dtype)
    return np.lib.format.open_memmap(path, mode="r+")
