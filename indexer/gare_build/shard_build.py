"""Sharded indexes on the write side: `gare-index build --shards N`, and add / remove / biases / verify / stats / gc
on a sharded root (the layout and the generation files: :mod:`gare_index.shards`).

Every change runs in three steps, under the root's build lock:

1. the structural change, shard by shard, with the single-index commands (:func:`gare_build.build.build` on
   the shard's part of the scanned clips, :func:`gare_build.build.remove`): each writes a normal version of its
   shard (atomic, kill-safe), with what only the whole gallery can give left to step 2: no NCL fit
   (``BuildOptions.defer_biases``: the biases are fitted once per change), no InvGC on build (its means come from
   the gallery), no stage-1 tuning (it measures coverage with the biases);
2. the global parts (:mod:`gare_build.shard_global`): InvGC's means (``build --invgc``), the NCL biases and,
   with validation captions (``--ncl-val``, or those the index decided on), the NCL default (``biases.default``)
   computed once over the whole gallery (every shard's videos, in shard order) by the single-index code, each
   shard's slice stored in one more version of that shard (the same default record in every shard), with its ANN
   over its stage-1 vectors and, for build and add, its stage-1 tuning and psi coverage;
3. the commit point: :func:`gare_index.shards.write_generation` names those versions and switches GENERATION.

A run killed before step 3 leaves the previous generation current and served: its shard versions are never
deleted (gc keeps what the current and the previous generation name), and the next run first sets every shard's
CURRENT back to the generation's version, so no orphan version of a dead run is built upon.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gare.checkpoint import load_model
from gare.model import resolve_device
from gare_build.build import (
    BUILD_LOCK,
    BuildOptions,
    RunReport,
    build,
    remove,
    reported,
)
from gare_build.discover import discover, scan
from gare_build.pipeline.options import progress_enabled
from gare_build.pipeline.plan import postprocess_setup, resolve_fields
from gare_build.pipeline.stats import stats
from gare_build.retune import retune
from gare_build.shard_global import DEFERRED, GlobalStep, RowConcat, global_step
from gare_index.shards import (
    agreed_ncl_default,
    current_generation,
    live_versions,
    shard_of,
    shard_root,
    split_id,
    write_generation,
)
from gare_index.store import (
    CURRENT_FILE,
    IndexFormatError,
    IndexVersion,
    current_version_name,
    gc,
    index_lock,
    open_version,
    switch_current,
    verify_index,
)

__all__ = ["build_sharded", "remove_sharded", "biases_sharded", "verify_sharded", "stats_sharded", "gc_sharded",
           "RowConcat"]

log = logging.getLogger(__name__)

# the shard commands write their versions without removing any (keep = "all"): what gc may remove is decided
# after the generation switch, from the live generations (gare_index.shards.live_versions)
_KEEP_ALL = 1 << 30
_INVGC_KEYS = ("r_g", "r_q", "k_percent", "mean_g", "mean_q", "n_gallery_for_means")  # one correction for all shards
_COUNTS = ("added", "updated", "unchanged", "removed", "encoded", "from_cache", "from_index", "frames_encoded")


# ------------------------------------------------------------------------------------------ helpers
def _root(out: str | os.PathLike) -> Path:
    return Path(out).expanduser().absolute()


def _require_generation(root: Path) -> Any:
    gen = current_generation(root)
    if gen is None:
        raise IndexFormatError(f"{root}: no generation yet (a sharded build never finished); run "
                               "`gare-index build --shards N` first")
    return gen


def _resume_generation(root: Path, report: RunReport) -> Any:
    """The opening of a command that changes an existing sharded index (remove, biases, tune): its current
    generation (an error when there is none), every shard back at the version it names, recorded as the
    report's previous version."""
    gen = _require_generation(root)
    _reset_shards(root, gen)
    report.previous_version = f"g{gen.number:06d}"
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


def _absorb(report: RunReport, sub: RunReport, shard: int) -> int:
    """Add a shard command's counts, skips and notes to the sharded run's report; returns 1 when that command
    fitted NCL biases of its own (its report's biases are not the deferred record), else 0."""
    for k in _COUNTS:
        setattr(report, k, getattr(report, k) + getattr(sub, k))
    report.encode_s += sub.encode_s
    report.skipped += [dict(s, shard=shard) for s in sub.skipped]
    report.notes += [f"shard {shard}: {n}" for n in sub.notes]
    report.index_type = report.index_type or sub.index_type
    return int(bool(sub.biases) and sub.biases.get("source") != DEFERRED)


def _step1_options(opts: BuildOptions) -> BuildOptions:
    """A shard's build/add options in step 1: every shard version kept (gc runs after the switch), the NCL fit
    and the stage-1 tuning left to step 2 (they need the whole gallery's biases), InvGC off for build (step 2
    computes it over the whole gallery; add keeps the index's recorded correction, applied to new videos)."""
    # ncl_val: the NCL default is decided in step 2 over the whole gallery (a deferred fit has nothing to decide on)
    o = dataclasses.replace(opts, keep=_KEEP_ALL, defer_biases=True, ncl_val=None,
                            stage1=dataclasses.replace(opts.stage1, enabled=False))
    if opts.invgc:
        o = dataclasses.replace(o, invgc=False, invgc_val=None, invgc_r_g=None, invgc_r_q=None)
    return o


def _invgc_setup(checkpoint: Any, gen_checkpoint: str | None, opts: BuildOptions) -> dict[str, Any]:
    """`build --shards N --invgc`: the choice of (r_g, r_q) of a single build (given, or the validation search of
    gare_build.pipeline.plan.postprocess_setup), made once for all shards, before anything is encoded."""
    path = checkpoint or gen_checkpoint
    if not path:
        raise ValueError("--checkpoint is required to build a new index")
    if not Path(path).expanduser().is_file():
        raise ValueError(f"--checkpoint {path}: no such file")
    model, ckpt = load_model(Path(path).expanduser().absolute(), resolve_device(opts.device))
    post = postprocess_setup(opts, "build", {}, model, ckpt, opts.precision or "fp32")
    del model
    return post


def _previous(root: Path, gen: Any) -> IndexVersion:
    """The generation's version of shard 0 (open it with ``with``): the defaults of the global bias fit."""
    return open_version(shard_root(root, 0), gen.versions[0], use_gpu=False)


def _commit(root: Path, versions: list[str], report: RunReport, keep: int, shard_fits: int) -> None:
    """Step 3: switch the generation, then remove shard versions beyond `keep` that no live generation names.
    The report's biases say how many NCL fits the change ran: the global one, plus any shard command's own."""
    report.biases = {**report.biases, "fits": {"global": 1, "shards": shard_fits}}
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
        invgc = None
        if mode == "build" and opts.invgc:
            ck = None
            if gen is not None:
                with _previous(root, gen) as v0:
                    ck = v0.manifest.checkpoint.path if v0.manifest.checkpoint else None
            invgc = _invgc_setup(checkpoint, ck, opts)

        # discover and scan once (unchanged files keep their stored checksums), then split by content
        clips, skipped, ignored = discover(videos)
        known: dict[str, dict[str, Any]] = {}
        rows_of: dict[int, list[dict[str, Any]]] = {}
        prev_fields: dict[str, str] | None = None
        if gen is not None:
            for s, name in enumerate(gen.versions):
                with open_version(shard_root(root, s), name, use_gpu=False) as v:
                    rows_of[s] = v.all_metadata()
                    prev_fields = dict(v.manifest.fields or {})
                known.update({r["path"]: r for r in rows_of[s]})
        # the fields' types are decided once over every clip (a shard alone could infer another type), then declared
        opts = dataclasses.replace(opts, fields=resolve_fields(clips, prev_fields, opts.fields, adding=mode == "add"))
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
        fits = 0
        for s in range(n):
            sroot = shard_root(root, s)
            if s in moved:
                sub = remove(sroot, moved[s], checkpoint=checkpoint, keep=_KEEP_ALL, defer_biases=True)
                fits += _absorb(report, sub, s)
            if mode == "add" and not parts[s]:
                continue
            sub = build(checkpoint, videos, sroot, dataclasses.replace(_step1_options(opts), clips=parts[s]), mode=mode)
            fits += _absorb(report, sub, s)
            report.ncl_stage1 = sub.ncl_stage1
            report.invgc = sub.invgc
            log.info("shard %d of %d: %s", s, n, sub.summary())
        # steps 2 and 3: the global parts, then the generation switch (the commit point)
        step = GlobalStep(invgc=invgc, tune=opts, checkpoint=checkpoint, n_iters=opts.n_iters,
                          queue_kind=opts.bias_queue, captions=opts.bias_captions, ncl_val=opts.ncl_val,
                          ncl_gammas=opts.ncl_gammas)
        if mode == "build":  # a single build's fit: the options' score and K, no traffic bank
            step.score, step.k, step.carry_traffic = opts.bias_score or "served", opts.bias_k, False
            _commit(root, global_step(root, n, report, step), report, opts.keep, fits)
        else:  # a single add's: the index's score and K unless --bias-score is given, its traffic bank carried,
            # and its NCL default decided again on the captions it was decided on (unless --ncl-val names others)
            step.score, step.k = opts.bias_score, (opts.bias_k if opts.bias_score else None)
            with _previous(root, gen) as v0:
                step.defaults = v0
                versions = global_step(root, n, report, step)
            _commit(root, versions, report, opts.keep, fits)
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
        gen = _resume_generation(root, report)
        fits = 0
        for s, local in sorted(_route_items(root, gen, items).items()):
            fits += _absorb(report, remove(shard_root(root, s), local, checkpoint=checkpoint, keep=_KEEP_ALL,
                                           defer_biases=True), s)
        # a single remove's fit: the index's score, K, iterations, traffic bank and validation captions (the NCL
        # default decided again over the videos left), as the generation's shard 0 records them
        with _previous(root, gen) as v0:
            versions = global_step(root, gen.n_shards, report, GlobalStep(checkpoint=checkpoint, defaults=v0))
        _commit(root, versions, report, keep, fits)
    return report


def biases_sharded(out: str | os.PathLike, *, checkpoint: Any = None, keep: int = 3, n_iters: int | None = None,
                   traffic: Any = None, traffic_weight: float = 0.5, score: str | None = "served",
                   k: int | None = None, queue_kind: str | None = None, captions: Any = None,
                   ncl_val: Any = None, gamma_factors: Any = None) -> RunReport:
    """`gare-index biases` on a sharded root: the biases refitted over the whole gallery, a new generation
    (`queue_kind` / `captions`: the NCL queue, as `gare-index biases --bias-queue / --bias-captions`; `ncl_val`:
    validation captions deciding the NCL default over the whole gallery, default those the index decided on)."""
    root = _root(out)
    report = RunReport(command="biases", index=str(root))
    with reported(root, report), index_lock(root, BUILD_LOCK, blocking=False):
        if not 0.0 <= traffic_weight <= 1.0:
            raise ValueError(f"--traffic-weight must be in [0, 1], got {traffic_weight}")
        gen = _resume_generation(root, report)
        step = GlobalStep(checkpoint=checkpoint, n_iters=n_iters, traffic=traffic, traffic_weight=traffic_weight,
                          score=score, k=k, carry_traffic=False, queue_kind=queue_kind, captions=captions,
                          ncl_val=ncl_val, ncl_gammas=gamma_factors)
        _commit(root, global_step(root, gen.n_shards, report, step), report, keep, 0)
    return report


def tune_sharded(out: str | os.PathLike, *, options: Any = None, checkpoint: Any = None, captions: Any = None,
                 index_type: str | None = None, keep: int = 3, progress: bool | None = None) -> RunReport:
    """`gare-index tune` on a sharded root: each shard's stage 1 tuned again on the same queries (a bank of served
    queries, captions, or the build's mix) over that shard's videos, as a new shard version, then one new
    generation naming them all. Nothing else changes (the biases and their NCL default are the whole gallery's).
    A shard whose tuning fails leaves the generation as it was: the shards go back to the versions it names."""
    root = _root(out)
    report = RunReport(command="tune", index=str(root))
    with reported(root, report), index_lock(root, BUILD_LOCK, blocking=False):
        gen = _resume_generation(root, report)
        versions, entries = [], []
        try:
            for s in range(gen.n_shards):
                sub = retune(shard_root(root, s), options=options, checkpoint=checkpoint, captions=captions,
                             index_type=index_type, keep=_KEEP_ALL, progress=progress)
                versions.append(sub.version)
                entries.append({"shard": s, **(sub.stage1 or {})})
                report.index_type = report.index_type or sub.index_type
        except BaseException:
            _reset_shards(root, gen)  # the shards tuned so far go back to the generation's versions
            raise
        # the generation's stage-1 record: the lowest shard recall (what every shard meets), each shard's own
        worst = min(entries, key=lambda e: e.get("recall", 1.0))
        report.stage1 = {**{k: v for k, v in worst.items() if k != "shard"}, "shards": entries}
        new = write_generation(root, versions)
        report.version = f"g{new.number:06d}"
        report.n_videos = sum(_n_of(shard_root(root, s), v) for s, v in enumerate(versions))
        gc_sharded(root, keep=keep)
    return report


def verify_sharded(out: str | os.PathLike, *, rehash: bool = True, expect_checkpoint_sha: str | None = None,
                   check_files: bool = False) -> list[str]:
    """Problems of the current generation: every shard's version (gare_index.store.verify_index), every video in
    the shard its checksum names, no file in two shards, one checkpoint, one bias fit and one NCL default
    (biases.default) for all shards."""
    root = _root(out)
    try:
        gen = _require_generation(root)
    except IndexFormatError as e:
        return [str(e)]
    problems: list[str] = []
    seen: dict[str, int] = {}
    fits: set[str] = set()
    invgcs: set[str] = set()
    manifests: list[Any] = []
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
            manifests.append(v.manifest)
            for r in v.all_metadata():
                want = shard_of(r["checksum"], gen.n_shards) if r.get("checksum") else None
                if want != s:
                    problems.append(f"shard {s} ({name}): video {r['id']} ({r['path']}) belongs in shard {want}")
                if seen.setdefault(r["path"], s) != s:
                    problems.append(f"{r['path']} is in shard {seen[r['path']]} and in shard {s}")
            scope = (v.manifest.biases or {}).get("scope") or {}
            fits.add(f"{v.manifest.checkpoint_sha256}|{scope.get('n_shards')}|{scope.get('n_videos')}")
            if (v.manifest.biases or {}).get("source") == DEFERRED:
                problems.append(f"shard {s} ({name}): its NCL biases were never fitted (a step-1 version)")
            inv = v.manifest.invgc
            invgcs.add(json.dumps({k: inv.get(k) for k in _INVGC_KEYS}, sort_keys=True) if inv else "none")
    if len(fits) > 1:
        problems.append(f"the shards' biases do not come from one fit over the whole gallery: {sorted(fits)}")
    if len(invgcs) > 1:  # one correction for the whole gallery, or the stage-1 vectors are not a single index's
        problems.append(f"the shards' InvGC corrections differ ({', '.join(_INVGC_KEYS)}): {sorted(invgcs)}")
    try:  # one NCL default over the whole gallery, or the served default would depend on which shard is read
        agreed_ncl_default(manifests)
    except IndexFormatError as e:
        problems.append(str(e))
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
