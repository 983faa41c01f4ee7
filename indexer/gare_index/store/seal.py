"""The seal of a version's manifest: ``manifest.json.xxh3`` holds the fast hash of manifest.json's exact bytes.

The manifest records the hashes of every other file of the version (``files``), but not its own: a byte changed
inside a file's ``sha256`` record, a field no check at open reads, would be served unnoticed. The seal closes
that: one line, ``"<scheme>:<hex>\\n"``, the value :class:`gare_index.store.fast_hash.FastHasher` gives for the
manifest's bytes (scheme ``xxh3-128-b64m``, the same value a ``files[name].fast_hash`` record holds for a file).
:func:`seal_status` is checked first by every check of a version's files (``check_files``, ``verify``).

:func:`write_sealed_manifest` writes the pair: manifest.json, then its seal, each with a temp name and
``os.replace``. The writer fills a fresh ``versions/.tmp-*`` directory renamed into place afterwards, so a crash
leaves no version at all; written into an existing directory, a crash between the two files leaves the new
manifest beside the old seal (a mismatch: refused) or beside no seal (unsealed: served with a warning), never a
seal that vouches for bytes it was not computed from. XXH3 is not a cryptographic hash: the seal catches a
manifest altered by accident or by someone who does not also rewrite the seal.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gare_index.store.fast_hash import FAST_HASH_SCHEME, FastHasher, split_fast_hash
from gare_index.store.format import MANIFEST_FILE, atomic_write_text

__all__ = ["SEAL_FILE", "SealStatus", "manifest_seal", "seal_status", "unsealed_warning", "write_seal",
           "write_sealed_manifest"]

SEAL_FILE = MANIFEST_FILE + ".xxh3"


def manifest_seal(data: bytes) -> str:
    """The seal of a manifest's bytes: ``"xxh3-128-b64m:<hex>"`` (the file holds this and a newline)."""
    h = FastHasher()
    h.update(data)
    return h.hexdigest()


@dataclass(frozen=True)
class SealStatus:
    """The seal of one version: ``state`` is ``"sealed"`` (the seal matches the manifest), ``"unsealed"`` (no seal:
    a version written before seals) or ``"bad"`` (``problem`` says why, naming manifest.json)."""

    state: Literal["sealed", "unsealed", "bad"]
    problem: str = ""

    @property
    def ok(self) -> bool:
        return self.state != "bad"


def seal_status(vdir: str | Path, data: bytes | None = None) -> SealStatus:
    """Check the seal of the version directory `vdir` against manifest.json's bytes (`data`: those bytes, already
    read by the caller; else read here)."""
    vdir = Path(vdir)
    mpath = vdir / MANIFEST_FILE
    try:
        raw = (vdir / SEAL_FILE).read_bytes()
    except FileNotFoundError:
        return SealStatus("unsealed")
    except OSError as e:
        return SealStatus("bad", f"{mpath}: its seal {SEAL_FILE} is unreadable ({e})")
    if data is None:
        try:
            data = mpath.read_bytes()
        except OSError as e:
            return SealStatus("bad", f"{mpath}: unreadable ({e})")
    if raw == _seal_bytes(data):  # byte for byte: no byte of either file may differ
        return SealStatus("sealed")
    try:
        scheme, _ = split_fast_hash(raw.decode("ascii").removesuffix("\n"))
    except (UnicodeDecodeError, ValueError):
        return SealStatus("bad", f"{mpath}: its seal {SEAL_FILE} is not '<scheme>:<hex>' ({raw[:80]!r})")
    if scheme != FAST_HASH_SCHEME:
        return SealStatus("bad", f"{mpath}: its seal {SEAL_FILE} uses scheme {scheme!r}, this reader knows "
                                 f"{FAST_HASH_SCHEME!r} only")
    return SealStatus("bad", f"{mpath}: does not match its seal {SEAL_FILE} (manifest or seal altered or corrupted)")


def unsealed_warning(vdir: Path) -> str:
    """The one WARNING an unsealed version gets when it is checked: which version, and how to seal it."""
    return (f"index version {vdir.name} ({vdir}) has no {SEAL_FILE} (written before manifests were sealed): its "
            f"manifest is trusted as read; seal it with `gare-index seal --index {vdir.parent.parent} --version "
            f"{vdir.name}` (it verifies every file's hashes first)")


def _seal_bytes(data: bytes) -> bytes:
    """The seal file's exact content for the manifest bytes `data`."""
    return (manifest_seal(data) + "\n").encode("ascii")


def write_seal(vdir: str | Path, data: bytes) -> None:
    """Write the seal of the manifest bytes `data` into `vdir` (temp name, fsync, ``os.replace``)."""
    atomic_write_text(Path(vdir) / SEAL_FILE, _seal_bytes(data).decode("ascii"))


def write_sealed_manifest(vdir: str | Path, text: str) -> None:
    """Write manifest.json (`text`) and its seal into `vdir`: the manifest first, then the seal of its bytes,
    each atomically (see the module docstring for what a crash between the two leaves)."""
    vdir = Path(vdir)
    atomic_write_text(vdir / MANIFEST_FILE, text)
    write_seal(vdir, (vdir / MANIFEST_FILE).read_bytes())
