"""Sharded indexes: the layout of INDEX/shards/sNNN, the generation files that pin one version of every shard,
the routing of a video to its shard and the global video ids.

Layout::

    INDEX/
      shards/s000, s001, ...       each a normal index directory (gare_index.store: versions/, CURRENT, ...)
      generations/g000001.json     {"generation": 1, "n_shards": N, "versions": ["v000003", ...], "created": ...}
      GENERATION                   the current generation file's name ("g000001.json"), switched atomically

A shard's CURRENT is the builder's working state; readers never follow it: they read GENERATION, then the
(immutable) generation file, then open exactly the versions it names, so no reader mixes shard versions. The
switch of GENERATION (temp file + os.replace) is the commit point of every sharded change.

A video goes to shard ``shard_of(checksum, N)``; a shard keeps its own local ids and users see
``global_id(shard, local, N) = local * N + shard``.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gare_index.describe import index_ncl_default
from gare_index.store import (
    VERSIONS_DIR,
    IndexFormatError,
    IndexVersion,
    atomic_write_text,
    open_version,
)

__all__ = ["SHARDS_DIR", "GENERATIONS_DIR", "GENERATION_FILE", "shard_of", "global_id", "split_id", "shard_name",
           "shard_root", "generation_file_name", "Generation", "list_generations", "read_generation",
           "current_generation", "previous_generation", "live_versions", "is_sharded", "write_generation",
           "ShardedIndex", "open_sharded", "agreed_ncl_default"]

SHARDS_DIR = "shards"
GENERATIONS_DIR = "generations"
GENERATION_FILE = "GENERATION"
_GEN_RE = re.compile(r"^g(\d{6,})\.json$")
_VERSION_RE = re.compile(r"^v\d{6,}$")  # a shard version's name (gare_index.store.version_name)


# ------------------------------------------------------------------------------------------ routing and ids
def shard_of(content_id: str, n_shards: int) -> int:
    """The shard of a video: int(sha256(content_id) hex, 16) % n_shards, content_id = the file's sha256 checksum
    (so every window of one file lands in one shard, and a renamed file stays where it was)."""
    if not isinstance(content_id, str) or not content_id:
        raise ValueError(f"shard_of: content id must be a non-empty string (the file's sha256), got {content_id!r}")
    _check_n(n_shards)
    return int(hashlib.sha256(content_id.encode("utf-8")).hexdigest(), 16) % n_shards


def global_id(shard: int | np.ndarray, local: int | np.ndarray, n_shards: int) -> Any:
    """The id users see: local * n_shards + shard (scalars or int64 arrays)."""
    _check_n(n_shards)
    s, lo = np.asarray(shard, dtype=np.int64), np.asarray(local, dtype=np.int64)
    if np.any(s < 0) or np.any(s >= n_shards):
        raise ValueError(f"global_id: shard {shard!r} is not in [0, {n_shards})")
    if np.any(lo < 0):
        raise ValueError(f"global_id: local id {local!r} is negative")
    g = lo * n_shards + s
    return int(g) if g.ndim == 0 else g


def split_id(gid: int | np.ndarray, n_shards: int) -> tuple[Any, Any]:
    """(shard, local) of a global id (scalars or int64 arrays); the inverse of :func:`global_id`."""
    _check_n(n_shards)
    g = np.asarray(gid, dtype=np.int64)
    if np.any(g < 0):
        raise ValueError(f"split_id: global id {gid!r} is negative")
    s, lo = g % n_shards, g // n_shards
    return (int(s), int(lo)) if g.ndim == 0 else (s, lo)


def _check_n(n_shards: int) -> None:
    if isinstance(n_shards, bool) or not isinstance(n_shards, (int, np.integer)) or n_shards < 1:
        raise ValueError(f"the number of shards must be an integer >= 1, got {n_shards!r}")


def shard_name(shard: int) -> str:
    return f"s{int(shard):03d}"


def shard_root(root: str | os.PathLike, shard: int) -> Path:
    """INDEX/shards/sNNN: a normal index directory."""
    return Path(root) / SHARDS_DIR / shard_name(shard)


def generation_file_name(number: int) -> str:
    return f"g{int(number):06d}.json"


# ------------------------------------------------------------------------------------------ generations
@dataclass(frozen=True)
class Generation:
    """One version of every shard, switched as one (the generation file's content)."""

    number: int
    n_shards: int
    versions: tuple[str, ...]
    created: str = field(default="", compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {"generation": self.number, "n_shards": self.n_shards, "versions": list(self.versions),
                "created": self.created}


def list_generations(root: str | os.PathLike) -> list[int]:
    """Numbers of the generation files under INDEX/generations, oldest first."""
    gdir = Path(root) / GENERATIONS_DIR
    if not gdir.is_dir():
        return []
    return sorted(int(m.group(1)) for p in gdir.iterdir() if (m := _GEN_RE.match(p.name)))


def read_generation(root: str | os.PathLike, number: int) -> Generation:
    """The generation file ``number``, checked (IndexFormatError naming the file and what is wrong)."""
    path = Path(root) / GENERATIONS_DIR / generation_file_name(number)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise IndexFormatError(f"{path}: missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise IndexFormatError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise IndexFormatError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    gen, n, versions = raw.get("generation"), raw.get("n_shards"), raw.get("versions")
    if gen != number:
        raise IndexFormatError(f"{path}: 'generation' is {gen!r}, the file name says {number}")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise IndexFormatError(f"{path}: 'n_shards' must be an integer >= 1, got {n!r}")
    if not isinstance(versions, list) or len(versions) != n:
        raise IndexFormatError(f"{path}: 'versions' must list one version per shard ({n}), got {versions!r}")
    bad = [v for v in versions if not isinstance(v, str) or not _VERSION_RE.match(v)]
    if bad:
        raise IndexFormatError(f"{path}: not version names: {bad}")
    return Generation(number=gen, n_shards=n, versions=tuple(versions), created=str(raw.get("created") or ""))


def current_generation(root: str | os.PathLike) -> Generation | None:
    """The generation INDEX/GENERATION names; None when there is none yet (no GENERATION file)."""
    path = Path(root) / GENERATION_FILE
    try:
        name = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    m = _GEN_RE.match(name)
    if not m:
        raise IndexFormatError(f"{path}: {name!r} is not a generation file name (expected e.g. 'g000001.json')")
    return read_generation(root, int(m.group(1)))


def previous_generation(root: str | os.PathLike) -> Generation | None:
    """The newest generation older than the current one (what readers that opened before the last switch
    may still be serving); None when there is none."""
    cur = current_generation(root)
    if cur is None:
        return None
    older = [g for g in list_generations(root) if g < cur.number]
    return read_generation(root, older[-1]) if older else None


def live_versions(root: str | os.PathLike) -> dict[int, set[str]]:
    """shard -> the versions the current and the previous generation name: what gc must keep."""
    out: dict[int, set[str]] = {}
    for g in (current_generation(root), previous_generation(root)):
        if g is not None:
            for s, v in enumerate(g.versions):
                out.setdefault(s, set()).add(v)
    return out


def is_sharded(root: str | os.PathLike) -> bool:
    """Whether INDEX is a sharded root (a GENERATION file or a shards/ folder), not a single index."""
    root = Path(root)
    return (root / GENERATION_FILE).is_file() or (root / SHARDS_DIR).is_dir()


def write_generation(root: str | os.PathLike, versions: Sequence[str]) -> Generation:
    """Write the next generation file naming ``versions`` (one per shard, each an existing version of its shard),
    then switch INDEX/GENERATION to it atomically: the commit point of a sharded change. The caller holds the
    root's build lock (one writer at a time)."""
    root = Path(root)
    versions = tuple(str(v) for v in versions)
    if not versions:
        raise ValueError("write_generation: no shard versions given")
    cur = current_generation(root)
    if cur is not None and cur.n_shards != len(versions):
        raise ValueError(f"write_generation: {root} has {cur.n_shards} shards, got {len(versions)} versions "
                         "(changing the number of shards needs a new index)")
    for s, v in enumerate(versions):
        if not _VERSION_RE.match(v):
            raise ValueError(f"write_generation: shard {s}: {v!r} is not a version name")
        if not (shard_root(root, s) / VERSIONS_DIR / v / "manifest.json").is_file():
            raise IndexFormatError(f"write_generation: shard {s} has no complete version {v} "
                                   f"({shard_root(root, s) / VERSIONS_DIR / v})")
    number = max([0, *list_generations(root)]) + 1
    gen = Generation(number=number, n_shards=len(versions), versions=versions,
                     created=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"))
    (root / GENERATIONS_DIR).mkdir(parents=True, exist_ok=True)
    # the file first (immutable once written), then the pointer: a reader sees the old or the new generation
    atomic_write_text(root / GENERATIONS_DIR / generation_file_name(number), json.dumps(gen.to_dict(), indent=1))
    atomic_write_text(root / GENERATION_FILE, generation_file_name(number) + "\n")
    return gen


# ------------------------------------------------------------------------------------------ reading
def agreed_ncl_default(manifests: Sequence[Any]) -> dict[str, Any] | None:
    """The NCL default of a generation: the ``biases.default`` record that every shard's manifest holds
    (the builder decides it once over the whole gallery and writes the same record into every shard), or None
    when no shard has one. ``manifests``: an IndexManifest or its JSON dict per shard, in shard order.
    IndexFormatError naming the shards when their records differ (the generation mixes decisions)."""
    recs = []
    for m in manifests:
        b = (m.biases if hasattr(m, "biases") else (m or {}).get("biases")) or {}
        recs.append(b.get("default"))
    keys = [json.dumps(r, sort_keys=True, default=str) for r in recs]
    if len(set(keys)) > 1:
        groups: dict[str, list[int]] = {}
        for s, k in enumerate(keys):
            groups.setdefault(k, []).append(s)
        said = "; ".join(f"shards {v}: " + ("none" if recs[v[0]] is None else f"on={recs[v[0]].get('on')}")
                         for v in groups.values())
        raise IndexFormatError(f"the shards' NCL defaults (biases.default) differ ({said}): one generation must "
                               "hold one decision over the whole gallery; run `gare-index biases` on the root")
    return recs[0] if recs else None


@dataclass(eq=False)
class ShardedIndex:
    """One opened version of every shard, pinned to one generation; close it (or use it as a context manager)."""

    root: Path
    generation: Generation
    shards: list[IndexVersion]

    @property
    def n_shards(self) -> int:
        return self.generation.n_shards

    @property
    def n(self) -> int:
        """Videos in all shards."""
        return sum(v.n for v in self.shards)

    def ncl_default(self) -> tuple[bool, str] | None:
        """The generation's own NCL default and why (the biases.default every shard records, checked to agree:
        :func:`agreed_ncl_default`), as :func:`gare_index.describe.index_ncl_default` reads a single index's; None
        without a decision (the search's default applies)."""
        return index_ncl_default({"biases": {"default": agreed_ncl_default([v.manifest for v in self.shards])}})

    def global_ids(self, shard: int) -> np.ndarray:
        """The global ids of shard ``shard``'s videos, in its row order (int64)."""
        return global_id(np.full(self.shards[shard].n, shard), np.asarray(self.shards[shard].ids), self.n_shards)

    def metadata(self, gids: Sequence[int] | np.ndarray) -> list[dict[str, Any]]:
        """The metadata rows of global ids (each row's "id" the global id), in the given order; unknown ids skipped."""
        out: dict[int, dict[str, Any]] = {}
        shard, local = split_id(np.asarray(gids, dtype=np.int64).reshape(-1), self.n_shards)
        for s in np.unique(shard):
            for r in self.shards[int(s)].metadata(local[shard == s]):
                g = global_id(int(s), int(r["id"]), self.n_shards)
                out[g] = {**r, "id": g}
        return [out[int(g)] for g in np.asarray(gids, dtype=np.int64).reshape(-1) if int(g) in out]

    def close(self) -> None:
        for v in self.shards:
            v.close()

    def __enter__(self) -> ShardedIndex:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def open_sharded(root: str | os.PathLike, *, generation: int | Generation | None = None, **open_kw: Any) -> ShardedIndex:
    """Open the versions one generation names (default: the current one), one :class:`IndexVersion` per shard;
    ``open_kw`` goes to :func:`gare_index.store.open_version` (use_gpu, mmap_ann, verify, expect_checkpoint_sha)."""
    root = Path(root)
    if not root.is_dir():
        raise IndexFormatError(f"{root}: no such index directory")
    if isinstance(generation, Generation):
        gen = generation
    elif generation is not None:
        gen = read_generation(root, int(generation))
    else:
        gen = current_generation(root)
        if gen is None:
            raise IndexFormatError(f"{root}: no {GENERATION_FILE} file; not a sharded gare index "
                                   "(create one with gare-index build --shards N)")
    opened: list[IndexVersion] = []
    try:
        for s, name in enumerate(gen.versions):
            opened.append(open_version(shard_root(root, s), name, **open_kw))
    except BaseException:
        for v in opened:
            v.close()
        raise
    dims = {(v.dim, v.max_frames) for v in opened}
    shas = {v.checkpoint_sha256 for v in opened}
    if len(dims) > 1 or len(shas) > 1:
        for v in opened:
            v.close()
        raise IndexFormatError(f"{root}: generation {gen.number} mixes shards of different shapes {sorted(dims)} or "
                               f"checkpoints {sorted(str(s) for s in shas)}")
    return ShardedIndex(root=root, generation=gen, shards=opened)
