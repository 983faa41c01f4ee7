"""The global parts of a sharded change (step 2 of :mod:`gare_build.shard_build`): what a single index computes from its
whole gallery, computed once over every shard's videos (in shard order) and stored per shard, so that the merged
answer is what one index over the same videos gives.

1. InvGC (``build --invgc``): LocalAdj's centring means come from the gallery, so they are computed over the whole
   gallery (:func:`gare_build.pipeline.finish.invgc_vectors` on every shard's units, concatenated in shard order: the
   single-index code on the single index's rows), and each shard stores its slice of the corrected stage-1
   vectors (``ann_units``) and the same ``invgc`` record (r_g, r_q, k, means): an ``add`` corrects a new video
   with those recorded values on any shard, as a single index does. The query side keeps no InvGC state (the
   queries are not corrected), so every shard computes the same stage-1 query vectors.
2. The NCL biases: fitted once over the whole gallery by the single-index fitter
   (:func:`gare_build.pipeline.biases.biases_for`, whose served-score candidates come from the stage-1 vectors of
   step 1), each shard storing its slice. The shard commands of step 1 ran with their own fit deferred
   (``BuildOptions.defer_biases``), so a sharded change fits its biases once. With validation captions
   (``--ncl-val``, or those the previous generation decided on) the same call decides the index's NCL default
   (``biases.default``, :func:`gare_build.pipeline.biases.with_default`) on the whole gallery (every shard's rows
   in shard order, their metadata the captions are matched to): the single index's decision on the same videos,
   written as one record into every shard's manifest.
3. Each shard's ANN (rebuilt over the InvGC vectors when they changed) and, for build and add, its stage-1
   tuning and psi coverage with the global biases, K chosen for the score served by default (psi + biases when
   the decision says on, else psi alone; :func:`gare_build.tuning.version_tuning.tune_version_ann`, as the finish stage
   of a single build runs it; the step-1 shard builds skip it), written as one new version per shard (the other
   files hard-linked).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gare.checkpoint import load_model
from gare_build.build import BuildOptions, RunReport, carry_manifest, prev_files
from gare_build.pipeline.biases import biases_for, checkpoint_gamma_and_queue
from gare_build.pipeline.finish import invgc_vectors, make_ann
from gare_build.pipeline.options import progress_enabled
from gare_build.tuning.version_tuning import encode_captions, stored_consts, tune_version_ann
from gare_index.describe import STAGE1_KEY, index_ncl_default
from gare_index.shards import shard_root
from gare_index.store import ExistingFile, IndexVersion, open_index, write_version
from gare_search.search import NCL_DEFAULT

__all__ = ["GlobalStep", "RowConcat", "global_step", "DEFERRED"]

log = logging.getLogger(__name__)

DEFERRED = "deferred"  # the biases record ("source") of a shard version whose fit was left to the global step


class RowConcat:
    """The rows of several (n_i, ...) arrays (memmaps) as one (sum n_i, ...) array for row gathers
    (``x[rows]``): the global bias fit reads the candidates' frames and psi constants of the whole gallery
    without copying every shard's frames (n, f, d) into memory."""

    def __init__(self, parts: list[Any]) -> None:
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


@dataclass
class GlobalStep:
    """What step 2 recomputes, and with which settings (one per sharded command)."""

    # build --invgc: gare_build.pipeline.plan.postprocess_setup's result (r_g, r_q, k, selection, the queues as refs);
    # None: each shard's stage-1 vectors are kept as step 1 wrote them (add corrects new videos with the recorded
    # means there)
    invgc: dict[str, Any] | None = None
    # build / add: re-tune every shard's stage 1 with these options (stage1, tune_captions, index knobs, progress)
    # once its global biases are known; None (remove, biases): keep each shard's tuning, as a single index does
    tune: BuildOptions | None = None
    # the bias fit (gare_build.pipeline.biases.biases_for's arguments); None: the `defaults` version's
    checkpoint: str | os.PathLike | None = None
    n_iters: int | None = None
    score: str | None = None
    k: int | None = None
    traffic: Any = None
    traffic_weight: float = 0.5
    carry_traffic: bool = True
    queue_kind: str | None = None  # the NCL queue (fresh / stale, gare_build.pipeline.biases.bias_queue) and the
    captions: Any = None  # captions a fresh one re-encodes; None: as the `defaults` version's record says
    # validation captions deciding the NCL default (--ncl-val); None: those the `defaults` version decided on, if any
    ncl_val: Any = None
    ncl_gammas: Any = None  # gamma factors chosen among on the captions (--ncl-gammas); None: the recorded ones
    # the version whose manifest gives the fit's defaults (score, K, iterations, a traffic bank to carry): the
    # previous generation's shard 0 for add / remove; None: the new shard 0 (build: the explicit values above)
    defaults: IndexVersion | None = None


def _cat(parts: list[Any]) -> np.ndarray | None:
    return None if any(p is None for p in parts) else np.concatenate([np.asarray(p) for p in parts])


def global_step(root: Path, n_shards: int, report: RunReport, g: GlobalStep) -> list[str]:
    """Step 2 over every shard's current version (in shard order): InvGC and the biases of the whole gallery, each
    shard's ANN / tuning, one new version per shard; returns their names (for the generation switch)."""
    shards = [open_index(shard_root(root, s), use_gpu=False) for s in range(n_shards)]
    try:
        sizes = [v.n for v in shards]
        cuts = np.cumsum([0, *sizes])
        fresh: list[np.ndarray | None] = [None] * n_shards  # new stage-1 vectors per shard (InvGC), else None
        inv = None
        if g.invgc is not None:
            # the single index's InvGC of the same rows: the means over the whole gallery, then per item
            units = np.concatenate([np.asarray(v.units, dtype=np.float32) for v in shards])  # (n, d)
            whole, inv = invgc_vectors(units, [], None, "build", g.invgc)
            inv = {**inv, "scope": {"n_shards": n_shards, "n_videos": int(units.shape[0])}}
            fresh = [whole[cuts[s]:cuts[s + 1]] for s in range(n_shards)]
            report.invgc = inv
        stage1 = [f if f is not None else v.ann_units for f, v in zip(fresh, shards, strict=True)]
        # the gallery of a single index over the same videos, as row views: the fit's only inputs are these arrays
        # (its candidates are each queue query's exact stage-1 top K, so the row order does not matter)
        arrays: dict[str, Any] = {"units": _cat([v.units for v in shards]), "norms": _cat([v.norms for v in shards]),
                                  "masks": _cat([v.masks for v in shards]), "ann_units": _cat(stage1),
                                  "frames": RowConcat([v.frames for v in shards])}
        if all(v.psi_consts is not None for v in shards):
            arrays["psi_consts"] = RowConcat([v.psi_consts for v in shards])
        # the single index's metadata rows in the same order: the validation captions' true videos are rows of it
        metas = [r for v in shards for r in v.metadata(np.asarray(v.ids))]
        b, binfo = biases_for(g.defaults or shards[0], arrays, g.checkpoint, g.n_iters, traffic=g.traffic,
                              traffic_weight=g.traffic_weight, report=report, carry_traffic=g.carry_traffic,
                              score=g.score, k=g.k, queue_kind=g.queue_kind, captions=g.captions, ncl_val=g.ncl_val,
                              metas=metas, gamma_factors=g.ncl_gammas)
        binfo = {**binfo, "scope": {"n_shards": n_shards, "n_videos": int(len(b))}}
        report.biases = binfo
        ck = shards[0].manifest.checkpoint
        tuner = _Tuner(g.tune, g.checkpoint or (ck.path if ck else None)) if g.tune is not None else None
        # the score served by default (the decision, else the search's default): what stage 1's K is tuned for
        ncl_on = (index_ncl_default({"biases": binfo}) or (NCL_DEFAULT,))[0]
        names = []
        for s, v in enumerate(shards):
            names.append(_write_shard(v, b[cuts[s]:cuts[s + 1]], binfo, s, fresh[s], inv, tuner, report, ncl_on))
        return names
    finally:
        for v in shards:
            v.close()


class _Tuner:
    """Stage-1 tuning of each shard as the finish stage of a single build runs it (the checkpoint's queue as
    sample queries, optional caption texts), the model loaded once for all shards."""

    def __init__(self, opts: BuildOptions, checkpoint: Any) -> None:
        self.opts = opts
        self.enabled = opts.stage1.enabled
        if self.enabled:
            path = Path(str(checkpoint or "")).expanduser()
            if not checkpoint or not path.is_file():
                raise ValueError(f"stage-1 tuning of the shards: checkpoint {checkpoint} not found; pass --checkpoint")
            self.model, ckpt = load_model(path, "cpu")
            _, self.queue = checkpoint_gamma_and_queue(ckpt, raw=True)  # raw rows: psi needs |t|
            self.captions = encode_captions(self.model, list(opts.tune_captions)) if opts.tune_captions else None

    def tune(self, v: IndexVersion, stage1: np.ndarray, ann: Any, biases: np.ndarray, ncl_on: bool
             ) -> tuple[Any, dict[str, Any]]:
        """``ncl_on``: the index's NCL default; K is chosen for psi + biases when on, else psi alone (as
        gare_build.pipeline.finish tunes a single build), and the entry records which (``ncl_default``)."""
        if not self.enabled:  # --no-tune: the built ANN as it is, nothing recorded (as a single build)
            return ann, {STAGE1_KEY: None}
        requested = v.manifest.index_type_requested or "auto"
        ref = biases if ncl_on else np.zeros(len(biases), np.float32)  # (n_shard,) the exhaustive reference's b
        tuned, entry = tune_version_ann(stage1, np.asarray(v.ids), frames=v.frames, masks=v.masks, biases=ref,
                                        model=self.model, queue=self.queue, captions=self.captions, ann=ann,
                                        requested_type=requested, options=self.opts.stage1,
                                        progress=progress_enabled(self.opts.progress),
                                        stored=stored_consts(v, self.model))
        out = {"ann_params": tuned.params.to_dict(), STAGE1_KEY: {**entry, "ncl_default": ncl_on} if entry else entry}
        if tuned.cpu_index is not ann.cpu_index:
            out["ann_trained_n"] = int(stage1.shape[0])
        return tuned, out


def _write_shard(prev: IndexVersion, b: np.ndarray, binfo: dict[str, Any], shard: int, fresh: np.ndarray | None,
                 inv: dict[str, Any] | None, tuner: _Tuner | None, report: RunReport, ncl_on: bool) -> str:
    """A new version of one shard with its slice of the global biases (and of the InvGC vectors, an ANN over them,
    a re-tuned stage 1); every unchanged file hard-linked (ann_ncl.faiss, which folds the biases into stage 1, is
    rebuilt by write_version)."""
    names = ["ids", "norms", "units", "frames", "masks", "keys", "values", "psi_consts"]
    arrays: dict[str, Any] = prev_files(prev, names + ([] if fresh is not None else ["ann_units"]))
    arrays["biases"] = np.asarray(b, dtype=np.float32)
    files = prev.manifest.files
    # the builder record of the version that wrote the features (command, engine, ...), plus this step
    builder = dict(prev.manifest.to_dict().get("builder") or {}) | {"global_step": {"shard": shard}}
    extra = carry_manifest(prev.manifest) | {"biases": binfo, "builder": builder}
    ann: Any = ExistingFile(prev.path / "ann.faiss", files["ann.faiss"].sha256)
    if fresh is not None or tuner is not None:
        stage1 = np.asarray(prev.stage1_units if fresh is None else fresh, dtype=np.float32)
        index = prev.ann
        if fresh is not None:  # InvGC changed the stage-1 vectors: the ANN over them, as a single build makes it
            arrays["ann_units"] = fresh
            extra["invgc"] = inv
            requested = prev.manifest.index_type_requested or "auto"
            index, ainfo = make_ann(fresh, np.asarray(prev.ids), tuner.opts if tuner else BuildOptions(), None,
                                    requested, incremental=False, drop_ids=np.zeros(0, np.int64),
                                    new_rows=np.zeros(0, np.int64))
            extra |= ainfo
        if tuner is not None:
            index, tinfo = tuner.tune(prev, stage1, index, arrays["biases"], ncl_on)
            extra |= tinfo
            if shard == 0:
                report.stage1 = tinfo.get(STAGE1_KEY)
        report.index_type = index.params.index_type
        ann = index
    return write_version(prev.root, arrays, ExistingFile(prev.path / "meta.sqlite", files["meta.sqlite"].sha256),
                         extra, ann=ann, keep=None)
