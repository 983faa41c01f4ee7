"""Checking a version's files against the fast hashes of its manifest before it is served.

:func:`check_files` re-reads every file of ``manifest.files`` and compares it with its ``fast_hash``
(:mod:`gare_index.store.fast_hash`): 64 MiB blocks on a few threads, so its time is the bytes over the read
rate (page cache or disk) and the hashing rate (XXH3, several GB/s a core). A file whose entry has no fast hash
(a version written before they were recorded) or one of a scheme this reader does not know is checked against
its sha256 instead, slower (~1 GB/s a core), with one WARNING that says so. :class:`BackgroundCheck` runs the
same check on a thread so that it overlaps other loading work (the service starts it before loading the model,
``open_version(check=True)`` before opening FAISS and SQLite); whoever serves the version waits for its verdict
first. A mismatch is a :class:`IndexCheckError` naming every bad file.

Before the files, the check holds manifest.json to its seal (:mod:`gare_index.store.seal`): a manifest whose bytes
differ from what was sealed is a bad file like any other (a byte changed in a record no other check reads, a
file's sha256). A version without a seal (written before seals) is checked as before, with one WARNING.

The check reads the manifest the caller opened the version with (the copy in memory), so a file altered
together with the manifest on disk after the open is still caught.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from gare_index.store.fast_hash import (
    BLOCK_BYTES,
    FAST_HASH_SCHEME,
    READ_BYTES,
    combine_blocks,
    hash_block,
    split_fast_hash,
)
from gare_index.store.format import IndexFormatError
from gare_index.store.manifest import FileEntry
from gare_index.store.seal import seal_status, unsealed_warning

log = logging.getLogger(__name__)

__all__ = ["BackgroundCheck", "CheckReport", "IndexCheckError", "check_files", "default_check_threads"]


class IndexCheckError(IndexFormatError):
    """A version's files do not match the hashes of its manifest (altered, truncated, missing)."""

    def __init__(self, report: CheckReport) -> None:
        super().__init__("; ".join(report.problems))
        self.report = report


@dataclass(frozen=True)
class CheckReport:
    """What one check found: ``problems`` (one line per bad file, empty when every file matches), the files
    and bytes read, the seconds it took, the files checked with sha256 for want of a fast hash, and whether the
    manifest has a seal (False: a version written before seals; its manifest was trusted as read)."""

    path: Path
    problems: list[str]
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0
    sha256_files: list[str] = field(default_factory=list)
    sealed: bool = True

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def rate_bytes_s(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else float("inf")


def default_check_threads() -> int:
    """Threads of a check at open: a few cores' worth (the hash runs at several GB/s a core; more threads
    mostly wait on the same disk or memory bandwidth)."""
    return max(1, min(4, os.cpu_count() or 1))


class _Cancelled(Exception):
    pass


def _sha256(path: Path, stop: threading.Event) -> str:
    h = hashlib.sha256()
    buf = bytearray(READ_BYTES)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while got := fh.readinto(buf):
            if stop.is_set():
                raise _Cancelled
            h.update(view[:got])
    return h.hexdigest()


def check_files(path: str | os.PathLike, files: Mapping[str, FileEntry], *, threads: int | None = None,
                stop: threading.Event | None = None, warn_unsealed: bool = True) -> CheckReport:
    """Check manifest.json against its seal, then re-hash every file of `files` (``manifest.files``) in the version
    directory `path` against its fast hash (or its sha256 when it has none); `threads` (default
    :func:`default_check_threads`) hash blocks in parallel. `stop` set: the check ends early with the problem
    "check cancelled". `warn_unsealed`: log the WARNING of a version without a seal (the periodic re-check of a
    served version does not repeat the one its open gave)."""
    t0 = time.perf_counter()
    path = Path(path)
    stop = stop or threading.Event()
    threads = max(1, threads or default_check_threads())
    seal = seal_status(path)
    problems: list[str] = [] if seal.ok else [seal.problem]
    if seal.state == "unsealed" and warn_unsealed:
        log.warning("%s", unsealed_warning(path))
    fast: dict[str, tuple[int, int, str]] = {}  # name -> (fd, size, expected digest hex)
    slow: dict[str, str] = {}  # name -> expected sha256
    total = 0
    try:
        for fname, entry in sorted(files.items()):
            p = path / fname
            try:
                fd = os.open(p, os.O_RDONLY)
            except FileNotFoundError:
                problems.append(f"{p}: missing")
                continue
            size = os.fstat(fd).st_size
            if size != entry.bytes:
                os.close(fd)
                problems.append(f"{p}: {size} bytes, manifest says {entry.bytes}")
                continue
            total += size
            try:
                scheme, digest = split_fast_hash(entry.fast_hash) if entry.fast_hash else (None, "")
            except ValueError:  # not "<scheme>:<hex>": checked with sha256, as an unknown scheme is
                scheme, digest = None, ""
            if scheme == FAST_HASH_SCHEME:
                fast[fname] = (fd, size, digest)
            else:
                os.close(fd)
                slow[fname] = entry.sha256
        with ThreadPoolExecutor(threads, thread_name_prefix="gare-index-check") as pool:
            buffers = threading.local()

            def block(fd: int, off: int, size: int) -> bytes:
                if stop.is_set():
                    raise _Cancelled
                buf = getattr(buffers, "buf", None)
                if buf is None:
                    buf = buffers.buf = bytearray(READ_BYTES)
                return hash_block(fd, off, min(BLOCK_BYTES, size - off), buf)

            jobs = {name: [pool.submit(block, fd, off, size) for off in range(0, size, BLOCK_BYTES)]
                    for name, (fd, size, _) in fast.items()}
            sha_jobs = {name: pool.submit(_sha256, path / name, stop) for name in slow}
            for name, futs in jobs.items():
                try:
                    got = combine_blocks([f.result() for f in futs]).partition(":")[2]
                except _Cancelled:
                    raise
                except OSError as e:
                    problems.append(f"{path / name}: unreadable ({e})")
                    continue
                if got != fast[name][2]:
                    problems.append(f"{path / name}: fast hash ({FAST_HASH_SCHEME}) does not match the manifest "
                                    "(file altered or corrupted)")
            for name, fut in sha_jobs.items():
                try:
                    got = fut.result()
                except _Cancelled:
                    raise
                except OSError as e:
                    problems.append(f"{path / name}: unreadable ({e})")
                    continue
                if got != slow[name]:
                    problems.append(f"{path / name}: sha256 does not match the manifest (file altered or corrupted)")
    except _Cancelled:
        problems = [f"{path}: check cancelled"]
    finally:
        for fd, _, _ in fast.values():
            os.close(fd)
    report = CheckReport(path, problems, files=len(files), bytes=total, seconds=time.perf_counter() - t0,
                         sha256_files=sorted(slow), sealed=seal.state != "unsealed")
    if slow and not problems:
        log.warning("index version %s: %d file(s) have no fast hash in the manifest (written before fast hashes "
                    "were recorded, or by a newer gare-index): checked with sha256 instead, which is slower (%s); "
                    "the next version gare-index writes records them", path.name, len(slow), ", ".join(sorted(slow)))
    log.info("checked index version %s: %d files, %.1f MB in %.2f s (%.0f MB/s)%s", path.name, report.files,
             total / 1e6, report.seconds, report.rate_bytes_s / 1e6, "" if report.ok else f": {len(problems)} bad")
    return report


class BackgroundCheck:
    """:func:`check_files` on a daemon thread, started now; :meth:`wait` gives its report."""

    def __init__(self, path: str | os.PathLike, files: Mapping[str, FileEntry], *, threads: int | None = None) -> None:
        self.path = Path(path)
        self._stop = threading.Event()
        self._report: CheckReport | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(dict(files), threads), daemon=True,
                                        name=f"gare-index-check-{self.path.name}")
        self._thread.start()

    def _run(self, files: dict[str, FileEntry], threads: int | None) -> None:
        try:
            self._report = check_files(self.path, files, threads=threads, stop=self._stop)
        except BaseException as e:  # noqa: BLE001 - handed to the waiter
            self._error = e

    def done(self) -> bool:
        return not self._thread.is_alive()

    def cancel(self) -> None:
        """Stop reading (the version will not be served); :meth:`wait` then reports "check cancelled"."""
        self._stop.set()

    def wait(self, timeout: float | None = None) -> CheckReport:
        """The report (TimeoutError when the check is still running after `timeout` seconds)."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the file check of {self.path} is still running after {timeout} s")
        if self._error is not None:
            raise self._error
        assert self._report is not None
        return self._report
