"""The fast file hash a version's manifest records next to sha256 (``files[name].fast_hash``).

Opening a version for serving re-hashes every file against it (:mod:`gare_index.store.file_check`); sha256 stays
for ``gare-index verify``. The value is ``"<scheme>:<hex>"`` so that a later scheme is a new prefix, not a new
manifest field. Scheme ``xxh3-128-b64m``: the file is cut into blocks of 64 MiB (the last one shorter; an empty
file has none), each block is hashed with XXH3-128, and the value is the XXH3-128 of the blocks' 16-byte digests
concatenated in file order. Blocks make one large file (frames.npy: GBs) checkable on several cores at once,
and the streaming writer (:class:`FastHasher`) computes the same value from writes of any size.

XXH3 is not a cryptographic hash: it catches files altered by accident or by someone who cannot also rewrite
the manifest (who can rewrite the manifest can rewrite its sha256 too).
"""

from __future__ import annotations

import hashlib
import os

import xxhash

__all__ = ["BLOCK_BYTES", "FAST_HASH_SCHEME", "FastHasher", "combine_blocks", "fast_file_hash", "sha256_and_fast_hash",
           "split_fast_hash"]

FAST_HASH_SCHEME = "xxh3-128-b64m"
BLOCK_BYTES = 64 << 20  # one block: one task of a parallel check
READ_BYTES = 8 << 20  # one read into a reused buffer (64 MiB would be 64 MiB of memory per thread)


def combine_blocks(block_digests: list[bytes]) -> str:
    """The manifest value of a file whose blocks have these XXH3-128 digests (16 bytes each, in file order)."""
    return f"{FAST_HASH_SCHEME}:{xxhash.xxh3_128(b''.join(block_digests)).hexdigest()}"


def split_fast_hash(value: str) -> tuple[str, str]:
    """(scheme, hex digest) of a manifest value; ValueError naming it when it has no scheme prefix."""
    scheme, sep, digest = value.partition(":")
    if not sep or not scheme or not digest:
        raise ValueError(f"fast_hash {value!r} is not '<scheme>:<hex>'")
    return scheme, digest


class FastHasher:
    """Streaming :data:`FAST_HASH_SCHEME` of bytes written in pieces of any size (the index writers)."""

    def __init__(self) -> None:
        self._digests: list[bytes] = []
        self._block = xxhash.xxh3_128()
        self._in_block = 0  # bytes of the current block hashed so far

    def update(self, data: bytes | bytearray | memoryview) -> None:
        mv = memoryview(data).cast("B")
        while len(mv):
            take = min(len(mv), BLOCK_BYTES - self._in_block)
            self._block.update(mv[:take])
            self._in_block += take
            mv = mv[take:]
            if self._in_block == BLOCK_BYTES:
                self._digests.append(self._block.digest())
                self._block = xxhash.xxh3_128()
                self._in_block = 0

    def hexdigest(self) -> str:
        """The manifest value (``"xxh3-128-b64m:<hex>"``) of everything written so far."""
        tail = [self._block.digest()] if self._in_block else []
        return combine_blocks(self._digests + tail)


def hash_block(fd: int, offset: int, length: int, buf: bytearray) -> bytes:
    """XXH3-128 digest of `length` bytes of the open file `fd` from `offset`, read through `buf` (positional
    reads: threads share the descriptor). OSError when the file ends early (shrunk while it is read)."""
    h = xxhash.xxh3_128()
    view = memoryview(buf)
    done = 0
    while done < length:
        want = min(len(buf), length - done)
        got = os.preadv(fd, [view[:want]], offset + done)
        if got <= 0:
            raise OSError(f"file ended {length - done} bytes early (changed while it was hashed)")
        h.update(view[:got])
        done += got
    return h.digest()


def fast_file_hash(path: str | os.PathLike) -> str:
    """The :data:`FAST_HASH_SCHEME` value of a file on disk, read once, on this thread."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        buf = bytearray(min(READ_BYTES, max(size, 1)))
        digests = [hash_block(fd, off, min(BLOCK_BYTES, size - off), buf) for off in range(0, size, BLOCK_BYTES)]
    finally:
        os.close(fd)
    return combine_blocks(digests)


def sha256_and_fast_hash(path: str | os.PathLike) -> tuple[str, str]:
    """(sha256 hex, :data:`FAST_HASH_SCHEME` value) of a file on disk, both from one read (the writers)."""
    sha, fast = hashlib.sha256(), FastHasher()
    buf = bytearray(READ_BYTES)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while got := fh.readinto(buf):
            sha.update(view[:got])
            fast.update(view[:got])
    return sha.hexdigest(), fast.hexdigest()
