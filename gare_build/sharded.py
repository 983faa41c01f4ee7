"""Sharded indexes on the write side: `gare-index build --shards N`, and add / remove / biases / verify / stats / gc
on a sharded root (the layout and the generation files: :mod:`gare_index.shards`).

Every change runs in three steps, under the root's build lock:

1. the structural change, shard by shard, with the single-index commands (:func:`gare_build.build.build` on
   the shard's part of the scanned clips, :func:`gare_build.build.remove`): each writes a normal version of its
   shard (with every guarantee of one index: atomic versions, verify, kill-safety, stage-1 tuning and psi
   coverage of its own videos);
2. the global NCL biases: fitted once over the whole gallery (every shard's videos, in shard order) by the
   fitting code a single index uses (:func:`gare_build.pipeline.biases.biases_for`), then stored per shard
   (each shard's slice) in one more version of every shard (other files hard-linked);
3. the commit point: :func:`gare_index.shards.write_generation` names those versions and switches GENERATION.

A run killed before step 3 leaves the previous generation current and served: its shard versions are never
deleted (gc keeps what the current and the previous generation name), and the next run first sets every shard's
CURRENT back to the generation's version, so no orphan version of a dead run is built upon.

InvGC is refused with --shards: its LocalAdj centring means come from the gallery, and a per-shard gallery would
give each shard other stage-1 vectors than a single index over the same videos.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gare_build.build import (
    BUILD_LOCK,
    BuildOptions,
    RunReport,
    build,
    carry_manifest,
    prev_files,
    remove,
    reported,
)
from gare_build.discover import discover, scan
from gare_build.pipeline.biases import biases_for
from gare_build.pipeline.options import progress_enabled
from gare_build.pipeline.stats import stats
from gare_index.shards import (
    current_generation,
    live_versions,
    shard_of,
    shard_root,
    split_id,
    write_generation,
)
from gare_index.store import (
    CURRENT_FILE,
    ExistingFile,
    IndexFormatError,
    IndexVersion,
    current_version_name,
    gc,
    index_lock,
    open_index,
    open_version,
    switch_current,
    verify_index,
    write_version,
)

__all__ = ["build_sharded", "remove_sharded", "biases_sharded", "verify_sharded", "stats_sharded", "gc_sharded",
           "RowConcat"]

log = logging.getLogger(__name__)

# the shard commands write their versions without removing any (keep = "all"): what gc may remove is decided
# after the generation switch, from the live generations (gare_index.shards.live_versions)
_KEEP_ALL = 1 << 30
_COUNTS = ("added", "updated", "unchanged", "removed", "encoded", "from_cache", "from_index", "frames_encoded")


class RowConcat:
    """The rows of several (n_i, ...) arrays (memmaps) as one (sum n_i, ...) array for row gathers
    (``x[rows]``): the global bias fit reads the candidates' frames and psi constants of the whole gallery
    without copying every shard's frames (n, f, d) into memory."""

    def __init__(self, parts: Sequence[Any]) -> None:
        self.parts = list(parts)
        tails = {tuple(p.shape[1:]) for p in self.parts}
        if len(tails) != 1:
            raise ValueError(f"RowConcat: parts of different row shapes {sorted(tails)}")
        self.offsets = np.cumsum([0, *(int(p.shape[0]) for p in self.parts)])
        self.shape = (int(self.offsets[-1]), *tails.pop())
        self.dtype = self.parts[0].dtype
        self.ndim = len(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, rows: Any) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.int64)
        flat = rows.reshape(-1)
        if flat.size and (flat.min() < 0 or flat.max() >= self.shape[0]):
            raise IndexError(f"RowConcat: rows outside [0, {self.shape[0]})")
        out = np.empty((flat.size, *self.shape[1:]), dtype=self.dtype)
        part = np.searchsorted(self.offsets, flat, side="right") - 1
        for i in np.unique(part):
            sel = np.flatnonzero(part == i)
            out[sel] = np.asarray(self.parts[int(i)][flat[sel] - self.offsets[i]])
        return out.reshape(*rows.shape, *self.shape[1:])


# ------------------------------------------------------------------------------------------ helpers
def _root(out: str | os.PathLike) -> Path:
    return Path(out).expanduser().absolute()


def _require_generation(root: Path) -> Any:
    gen = current_generation(root)
    if gen is None:
        raise IndexFormatError(f"{root}: no generation yet (a sharded build never finished); run "
                               "`gare-index build --shards N` first")
    return gen


def _reset_shards(root: Path, gen: Any) -> None:
    """Every shard's CURRENT back to the version the generation names: a run killed before its generation
    switch may have moved some of them to versions no generation names."""
    if gen is None:
        return
    for s, name in enumerate(gen.versions):
        sroot = shard_root(root, s)
        try:
            cur = current_version_name(sroot)
        except IndexFormatError:
            cur = None
        if cur != name:
            log.warning("shard %d: CURRENT is %s, generation %d names %s (an interrupted run); switching it back",
                        s, cur, gen.number, name)
            switch_current(sroot, name)


def _absorb(report: RunReport, sub: RunReport, shard: int) -> None:
    """Add a shard command's counts, skips and notes to the sharded run's report."""
    for k in _COUNTS:
        setattr(report, k, getattr(report, k) + getattr(sub, k))
    report.encode_s += sub.encode_s
    report.skipped += [dict(s, shard=shard) for s in sub.skipped]
    report.notes += [f"shard {shard}: {n}" for n in sub.notes]
    report.index_type = report.index_type or sub.index_type


def _global_biases(root: Path, n_shards: int, report: RunReport, *, checkpoint: Any = None, n_iters: int | None = None,
                   traffic: Any = None, traffic_weight: float = 0.5, score: str | None = None, k: int | None = None,
                   carry_traffic: bool = True) -> list[str]:
    """Step 2: the NCL biases of the whole gallery (every shard's current version, in shard order), each shard's
    slice written as a new version of that shard; returns those versions' names, one per shard."""
    shards = [open_index(shard_root(root, s), use_gpu=False) for s in range(n_shards)]
    try:
        # the gallery of a single index over the same videos, as row views: the fit's only inputs are these
        # arrays (its candidates are each queue query's exact stage-1 top K, so the row order does not matter)
        def cat(name: str) -> Any:
            parts = [getattr(v, name) for v in shards]
            return None if any(p is None for p in parts) else np.concatenate([np.asarray(p) for p in parts])

        arrays: dict[str, Any] = {"units": cat("units"), "norms": cat("norms"), "masks": cat("masks"),
                                  "frames": RowConcat([v.frames for v in shards]), "ann_units": cat("ann_units")}
        if all(v.psi_consts is not None for v in shards):
            arrays["psi_consts"] = RowConcat([v.psi_consts for v in shards])
        # the fit of shard 0's version stands for all: same checkpoint, score, K and iterations (biases_for
        # defaults them to its manifest, which the shard build wrote as a single build would)
        b, binfo = biases_for(shards[0], arrays, checkpoint, n_iters, traffic=traffic, traffic_weight=traffic_weight,
                              report=report, carry_traffic=carry_traffic, score=score, k=k)
        binfo = {**binfo, "scope": {"n_shards": n_shards, "n_videos": int(len(b))}}
        report.biases = binfo
        names, at = [], 0
        for s, v in enumerate(shards):
            names.append(_write_biases(v, b[at:at + v.n], binfo, s))
            at += v.n
        return names
    finally:
        for v in shards:
            v.close()


def _write_biases(prev: IndexVersion, b: np.ndarray, binfo: dict[str, Any], shard: int) -> str:
    """A new version of one shard with these biases; every other file hard-linked (ann_ncl.faiss, which folds
    the biases into stage 1, is rebuilt), as `gare-index biases` writes it."""
    arrays: dict[str, Any] = prev_files(prev, ["ids", "norms", "units", "frames", "masks", "keys", "values",
                                               "ann_units", "psi_consts"])
    arrays["biases"] = np.asarray(b, dtype=np.float32)
    files = prev.manifest.files
    # the builder record of the version that wrote the features (command, engine, ...), plus this step
    builder = dict(prev.manifest.to_dict().get("builder") or {}) | {"global_biases": {"shard": shard}}
    extra = carry_manifest(prev.manifest) | {"biases": binfo, "builder": builder}
    return write_version(prev.root, arrays, ExistingFile(prev.path / "meta.sqlite", files["meta.sqlite"].sha256),
                         extra, ann=ExistingFile(prev.path / "ann.faiss", files["ann.faiss"].sha256), keep=None)


def _commit(root: Path, versions: list[str], report: RunReport, keep: int) -> None:
    """Step 3: switch the generation, then remove shard versions beyond `keep` that no live generation names."""
    gen = write_generation(root, versions)
    report.version = f"g{gen.number:06d}"
    if report.encode_s > 0:  # the shards' encoders ran one after the other: the run's rates are the totals'
        report.videos_per_s = round(report.encoded / report.encode_s, 3)
        report.frames_per_s = round(report.frames_encoded / report.encode_s, 3)
    report.n_videos = sum(_n_of(shard_root(root, s), v) for s, v in enumerate(versions))
    gc_sharded(root, keep=keep)


def _n_of(sroot: Path, name: str) -> int:
    with open_version(sroot, name, use_gpu=False) as v:
        return v.n


# ------------------------------------------------------------------------------------------ commands
def build_sharded(checkpoint: Any, videos: str | os.PathLike, out: str | os.PathLike, opts: BuildOptions | None = None,
                  *, n_shards: int | None = None, mode: str = "build") -> RunReport:
    """`gare-index build --shards N` (mode="build": the new generation holds exactly these videos) and `add` on
    a sharded root (mode="add"). The clips are discovered and scanned once, split by
    ``shard_of(checksum, N)``, and each shard's part is built (or added) as a normal index."""
    opts = opts or BuildOptions()
    opts.validate()
    if mode not in ("build", "add"):
        raise ValueError(f"mode must be build or add, got {mode!r}")
    if opts.invgc:
        raise ValueError("--invgc cannot be used with a sharded index: InvGC's LocalAdj centring comes from the "
                         "gallery, so per-shard vectors would differ from a single index's; build without --invgc")
    root = _root(out)
    root.mkdir(parents=True, exist_ok=True)
    report = RunReport(command=mode, index=str(root), engine=opts.engine)
    with reported(root, report), index_lock(root, BUILD_LOCK, blocking=False):
        gen = current_generation(root)
        if mode == "add" and gen is None:
            _require_generation(root)
        n = n_shards if n_shards is not None else (gen.n_shards if gen is not None else None)
        if n is None or n < 1:
            raise ValueError(f"--shards must be an integer >= 1 for a new sharded index, got {n_shards!r}")
        if gen is not None and n != gen.n_shards:
            raise ValueError(f"{root} has {gen.n_shards} shards; --shards {n} would move videos between shards "
                             "(re-sharding is not supported: build a new index)")
        _reset_shards(root, gen)
        report.previous_version = f"g{gen.number:06d}" if gen is not None else None

        # discover and scan once (unchanged files keep their stored checksums), then split by content
        clips, skipped, ignored = discover(videos)
        known: dict[str, dict[str, Any]] = {}
        rows_of: dict[int, list[dict[str, Any]]] = {}
        if gen is not None:
            for s, name in enumerate(gen.versions):
                with open_version(shard_root(root, s), name, use_gpu=False) as v:
                    rows_of[s] = v.all_metadata()
                known.update({r["path"]: r for r in rows_of[s]})
        clips, sk = scan(clips, known, threads=opts.scan_threads, progress=progress_enabled(opts.progress))
        report.ignored = [x.to_dict() for x in ignored]
        report.skipped = [x.to_dict() for x in skipped + sk]
        explicit = [c for c in clips if c.explicit_id]
        if explicit:
            raise ValueError(f"{explicit[0].source or explicit[0].path}: manifest ids cannot be used with a sharded "
                             "index (a shard assigns its own ids; the global id is local * N + shard)")
        parts: list[list[Any]] = [[] for _ in range(n)]
        for c in clips:
            parts[shard_of(c.checksum, n)].append(c)
        if mode == "build":
            empty = [s for s in range(n) if not parts[s]]
            if empty:
                raise ValueError(f"--shards {n}: shard(s) {empty} would hold no video ({len(clips)} usable files); "
                                 "use fewer shards")
        # add: a file whose content changed may now hash to another shard; its old rows leave their old shard
        moved: dict[int, list[str]] = {}
        if mode == "add":
            where = {c.path: shard_of(c.checksum, n) for c in clips}
            for s, rows in rows_of.items():
                gone = sorted({r["path"] for r in rows if where.get(r["path"], s) != s})
                if gone:
                    moved[s] = gone

        # step 1: every shard's structural change (a normal index build / add / remove each)
        for s in range(n):
            sroot = shard_root(root, s)
            if s in moved:
                sub = remove(sroot, moved[s], checkpoint=checkpoint, keep=_KEEP_ALL)
                _absorb(report, sub, s)
            if mode == "add" and not parts[s]:
                continue
            sopts = dataclasses.replace(opts, clips=parts[s], keep=_KEEP_ALL)
            sub = build(checkpoint, videos, sroot, sopts, mode=mode)
            _absorb(report, sub, s)
            report.stage1 = report.stage1 or sub.stage1
            report.ncl_stage1 = sub.ncl_stage1
            log.info("shard %d of %d: %s", s, n, sub.summary())
        # steps 2 and 3: the global biases, then the generation switch (the commit point)
        _commit(root, _global_biases(root, n, report), report, opts.keep)
    return report


def _route_items(root: Path, gen: Any, items: Sequence[str]) -> dict[int, list[str]]:
    """remove's items (global ids or paths) as each shard's local items; ValueError naming the unknown ones."""
    n = gen.n_shards
    per: dict[int, list[str]] = {}
    unknown: list[str] = []
    by_path: dict[str, int] = {}
    local_ids: dict[int, set[int]] = {}
    for s, name in enumerate(gen.versions):
        with open_version(shard_root(root, s), name, use_gpu=False) as v:
            local_ids[s] = {int(i) for i in np.asarray(v.ids)}
            by_path.update({r["path"]: s for r in v.all_metadata()})
    for it in items:
        x = str(it).strip()
        if x.lstrip("-").isdigit():
            if int(x) < 0:
                unknown.append(x)
                continue
            s, local = split_id(int(x), n)
            (per.setdefault(s, []).append(str(local)) if local in local_ids[s] else unknown.append(x))
        else:
            p = os.path.abspath(os.path.expanduser(x))
            (per.setdefault(by_path[p], []).append(p) if p in by_path else unknown.append(x))
    if unknown:
        raise ValueError(f"not in generation {gen.number} of {root}: {unknown}")
    return per


def remove_sharded(out: str | os.PathLike, items: Sequence[str], *, checkpoint: Any = None, keep: int = 3) -> RunReport:
    """`gare-index remove` on a sharded root: global ids (local * N + shard) or paths, each removed from its shard,
    then the global biases and a new generation."""
    root = _root(out)
    report = RunReport(command="remove", index=str(root))
    with reported(root, report), index_lock(root, BUILD_LOCK, blocking=False):
        gen = _require_generation(root)
        _reset_shards(root, gen)
        report.previous_version = f"g{gen.number:06d}"
        for s, local in sorted(_route_items(root, gen, items).items()):
            _absorb(report, remove(shard_root(root, s), local, checkpoint=checkpoint, keep=_KEEP_ALL), s)
        _commit(root, _global_biases(root, gen.n_shards, report, checkpoint=checkpoint), report, keep)
    return report


def biases_sharded(out: str | os.PathLike, *, checkpoint: Any = None, keep: int = 3, n_iters: int | None = None,
                   traffic: Any = None, traffic_weight: float = 0.5, score: str | None = "served",
                   k: int | None = None) -> RunReport:
    """`gare-index biases` on a sharded root: the biases refitted over the whole gallery, a new generation."""
    root = _root(out)
    report = RunReport(command="biases", index=str(root))
    with reported(root, report), index_lock(root, BUILD_LOCK, blocking=False):
        if not 0.0 <= traffic_weight <= 1.0:
            raise ValueError(f"--traffic-weight must be in [0, 1], got {traffic_weight}")
        gen = _require_generation(root)
        _reset_shards(root, gen)
        report.previous_version = f"g{gen.number:06d}"
        versions = _global_biases(root, gen.n_shards, report, checkpoint=checkpoint, n_iters=n_iters, traffic=traffic,
                                  traffic_weight=traffic_weight, score=score, k=k, carry_traffic=False)
        _commit(root, versions, report, keep)
    return report


def verify_sharded(out: str | os.PathLike, *, rehash: bool = True, expect_checkpoint_sha: str | None = None,
                   check_files: bool = False) -> list[str]:
    """Problems of the current generation: every shard's version (gare_index.store.verify_index), every video in
    the shard its checksum names, no file in two shards, one checkpoint and one bias fit for all shards."""
    root = _root(out)
    try:
        gen = _require_generation(root)
    except IndexFormatError as e:
        return [str(e)]
    problems: list[str] = []
    seen: dict[str, int] = {}
    fits: set[str] = set()
    for s, name in enumerate(gen.versions):
        sroot = shard_root(root, s)
        problems += [f"shard {s} ({name}): {p}" for p in verify_index(sroot, name=name, rehash=rehash,
                                                                        expect_checkpoint_sha=expect_checkpoint_sha,
                                                                        check_files=check_files)]
        try:
            v = open_version(sroot, name, use_gpu=False)
        except IndexFormatError:
            continue  # reported by verify_index
        with v:
            for r in v.all_metadata():
                want = shard_of(r["checksum"], gen.n_shards) if r.get("checksum") else None
                if want != s:
                    problems.append(f"shard {s} ({name}): video {r['id']} ({r['path']}) belongs in shard {want}")
                if seen.setdefault(r["path"], s) != s:
                    problems.append(f"{r['path']} is in shard {seen[r['path']]} and in shard {s}")
            scope = (v.manifest.biases or {}).get("scope") or {}
            fits.add(f"{v.manifest.checkpoint_sha256}|{scope.get('n_shards')}|{scope.get('n_videos')}")
    if len(fits) > 1:
        problems.append(f"the shards' biases do not come from one fit over the whole gallery: {sorted(fits)}")
    return problems


def stats_sharded(out: str | os.PathLike) -> dict[str, Any]:
    """`gare-index stats` on a sharded root: the generation, totals and every shard's figures."""
    root = _root(out)
    gen = _require_generation(root)
    per = []
    for s, name in enumerate(gen.versions):
        st = stats(shard_root(root, s))
        if st["version"] != name:  # stats reads the shard's CURRENT: pinned above, so this means a live writer
            raise IndexFormatError(f"shard {s}: CURRENT is {st['version']}, generation {gen.number} names {name} "
                                   "(a sharded run is in progress or was interrupted; run it again)")
        per.append(st)
    total = sum(st["bytes_total"] for st in per)
    n = sum(st["n"] for st in per)
    return {"index": str(root), "generation": gen.number, "n_shards": gen.n_shards, "versions": list(gen.versions),
            "created": gen.created, "n": n, "distinct_files": sum(st["distinct_files"] for st in per),
            "bytes_total": total, "bytes_per_video": round(total / n, 1) if n else None,
            "biases": per[0]["biases"], "shards": per}


def gc_sharded(out: str | os.PathLike, *, keep: int = 3) -> dict[int, list[str]]:
    """Remove every shard's versions beyond the newest `keep`, never one that the current or the previous
    generation names; returns shard -> removed versions."""
    root = _root(out)
    gen = _require_generation(root)
    live = live_versions(root)
    removed = {}
    for s in range(gen.n_shards):
        sroot = shard_root(root, s)
        if (sroot / CURRENT_FILE).is_file():
            removed[s] = gc(sroot, keep=keep, protect=live.get(s, set()))
    return removed
