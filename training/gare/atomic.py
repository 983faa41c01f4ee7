"""One atomic file write for the whole project (checkpoints, index files, work shards, banks, corpora).

Light on purpose (standard library only), so that any module may use it without importing torch.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def atomic_write(path: str | os.PathLike, write_fn: Callable[[str], object]) -> None:
    """Call write_fn(tmp_path), fsync, then rename over `path`: readers see the old file or the new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write_fn(tmp)
        # mkstemp creates 0600; give the file the mode a plain open() would (other users, e.g. a container's
        # non-root user, must be able to read a checkpoint)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
