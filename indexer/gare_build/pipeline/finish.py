"""Stage 4 of build/add, finish: the NCL biases, the optional InvGC stage-1 vectors, the ANN index (updated in
place from the previous version when possible) and the manifest, then `gare_index.store.write_version` (a complete
new version and an atomic switch of CURRENT)."""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from gare_build.invgc_fit import invgc_apply, invgc_means
from gare_build.pipeline.assemble import Entry
from gare_build.pipeline.biases import (
    bias_queue,
    bias_score_of,
    carried_traffic,
    compute_biases,
    served_inputs,
    traffic_binfo,
    with_default,
)
from gare_build.pipeline.options import BuildOptions, RunReport, progress_enabled
from gare_build.pipeline.plan import Plan
from gare_build.tuning.coverage import StoredConsts
from gare_build.tuning.version_tuning import encode_captions, tune_version_ann
from gare_index import psi_consts
from gare_index.ann import AnnIndex, build_index
from gare_index.ann_params import AnnParams, choose_index_type
from gare_index.describe import STAGE1_KEY, index_ncl_default
from gare_index.store import ExistingFile, IndexMismatchError, IndexVersion, write_version
from gare_search.search import NCL_DEFAULT

log = logging.getLogger(__name__)


def _ann_params(index_type: str, opts: BuildOptions, base: dict[str, Any] | None = None) -> AnnParams:
    d = dict(base or {})
    d["index_type"] = index_type
    for name in ("nlist", "nprobe", "hnsw_m", "ef_search", "ef_construction", "pq_m", "rescore"):
        v = getattr(opts, name)
        if v is not None:
            d[name] = v
    if base and base.get("index_type") != index_type:  # knobs of another type do not carry over
        d = {k: v for k, v in d.items() if k == "index_type" or getattr(opts, k, None) is not None}
    return AnnParams.from_dict(d)


def _choose_type(requested: str, n: int) -> str:
    if requested == "auto":
        return choose_index_type(n)
    if requested in ("ivf", "ivfpq") and n == 0:
        return "flat"
    return requested


def make_ann(units: np.ndarray, ids: np.ndarray, opts: BuildOptions, prev: IndexVersion | None, requested: str,
              *, incremental: bool, drop_ids: np.ndarray, new_rows: np.ndarray) -> tuple[AnnIndex, dict[str, Any]]:
    """The ANN index of the new version: updated in place from the previous one when possible, else built.

    Used by build/add (finish) and remove (``gare_build.build``)."""
    n = units.shape[0]
    t = _choose_type(requested, n)
    knobs = any(getattr(opts, k) is not None for k in ("nlist", "hnsw_m", "ef_construction", "pq_m"))
    if prev is not None and incremental and not opts.rebuild_ann and not knobs and prev.manifest.index_type == t:
        trained = int(prev.manifest.ann_trained_n or prev.n)
        if t not in ("ivf", "ivfpq") or n <= 2 * max(trained, 1):
            params = _ann_params(t, opts, prev.manifest.ann_params)
            ann = AnnIndex(prev.ann.cpu_index, params)
            if drop_ids.size:
                ann.remove_ids(drop_ids)
            if new_rows.size:
                ann.add(units[new_rows], ids[new_rows])
            return ann, {"ann_params": params.to_dict(), "ann_trained_n": trained}
    params = _ann_params(t, opts, prev.manifest.ann_params if prev is not None else None)
    t0 = time.time()
    # searched where the service opens it; a GPU here (not --device cpu) trains and fills IVF cells faster
    gpu_assign = False if opts.device == "cpu" else None
    ann = AnnIndex(build_index(units, ids, params, use_gpu=False, assign_on_gpu=gpu_assign), params)
    log.info("built a %s index over %d vectors in %.1fs", t, n, time.time() - t0)
    return ann, {"ann_params": params.to_dict(), "ann_trained_n": n}


def invgc_vectors(units: np.ndarray, entries: list[Entry], prev: IndexVersion | None, mode: str,
                   post: dict[str, Any]) -> tuple[np.ndarray, dict[str, Any]]:
    """The InvGC-corrected stage-1 vectors of every entry and the manifest's `invgc` record.

    build: LocalAdj's centring means come from this gallery (the result is gare.invgc.invgc of the
    units) and are recorded. add: rows carried from the previous version keep their vectors; new ones are
    corrected with the recorded r_g, r_q, k and means (the correction of an item depends only on the item)."""
    Gh, Qh = post["refs"]
    inv = dict(post["invgc"])
    k = float(inv["k_percent"])
    t0 = time.time()
    if mode == "add":
        if (int(inv["n_train_videos"]), int(inv["n_train_queries"])) != (Gh.shape[0], Qh.shape[0]):
            raise IndexMismatchError("the checkpoint's training queues differ in size from the ones the index's InvGC used")
        out = np.empty_like(units)
        todo = np.ones(len(entries), dtype=bool)
        if prev is not None and prev.ann_units is not None:
            dst = np.array([i for i, e in enumerate(entries) if e.src[0] == "prev"], dtype=np.int64)
            if dst.size:
                src = np.array([entries[i].src[1] for i in dst], dtype=np.int64)
                order = np.argsort(src, kind="stable")
                out[dst[order]] = np.asarray(prev.ann_units[src[order]], dtype=np.float32)
                todo[dst] = False
        rows = np.flatnonzero(todo)
        if rows.size:
            out[rows] = invgc_apply(units[rows], Gh, Qh, inv["r_g"], inv["r_q"], inv["mean_g"], inv["mean_q"], k)
        log.info("InvGC: corrected %d new vectors in %.1fs (r_g=%g, r_q=%g)", rows.size, time.time() - t0, inv["r_g"], inv["r_q"])
        return out, inv
    mean_g, mean_q = invgc_means(units, Gh, Qh, k)
    out = invgc_apply(units, Gh, Qh, inv["r_g"], inv["r_q"], mean_g, mean_q, k)
    inv.update(mean_g=mean_g, mean_q=mean_q, n_gallery_for_means=int(units.shape[0]),
               refs="checkpoint queues: 'video' (training videos, Ĝ) and 'text' (training queries, Q̂)",
               applied_to="ann_units.npy (stage 1: ann.faiss and ann_ncl.faiss); units.npy/norms.npy unchanged")
    log.info("InvGC: corrected %d vectors in %.1fs (r_g=%g, r_q=%g, k=%g%%)", units.shape[0], time.time() - t0,
             inv["r_g"], inv["r_q"], k)
    return out, inv


def finish(p: Plan, entries: list[Entry], arrays: dict[str, Any], opts: BuildOptions, report: RunReport, *,
           todo_ids: np.ndarray, kept_ids: np.ndarray, staging: Any = None) -> str:
    """Biases, stage-1 vectors, ANN and manifest of the assembled arrays; writes the version and returns its name."""
    prev, pman, mode, cfg = p.prev, p.pman, p.mode, p.model.cfg
    for e, u in zip(entries, arrays["masks"].sum(axis=1), strict=True):
        e.meta["frames_used"] = int(u)
    invgc_m = None
    if p.post["invgc"]:  # before the biases: the served biases take their candidates from the stage-1 vectors
        arrays["ann_units"], invgc_m = invgc_vectors(arrays["units"], entries, prev, mode, p.post)
    report.invgc = invgc_m
    # psi's folded per-video constants (gare_index.psi_consts): carried for unchanged rows, folded for the new ones; before
    # the biases, whose psi scores of Q x K queue pairs read them instead of folding each video again
    psi_fold = psi_consts.attach(arrays, p.model, prev, checkpoint_sha=p.sha, staging=staging, device=p.device)
    score = opts.bias_score or (bias_score_of(pman) if mode == "add" and pman else "served")
    served = served_inputs(p.model, arrays, opts.bias_k if mode != "add" or opts.bias_score else
                            int(((pman.get("biases") or {}).get("served") or {}).get("k") or opts.bias_k),
                            consts_valid=True) if score == "served" else None
    # the queue NCL fits to: fresh (training captions re-encoded by this model) or stale (docs/postprocessing.md)
    gamma, queue, qinfo = bias_queue(p.ckpt, p.model, opts.bias_queue, opts.bias_captions, report=report,
                                     prev=(pman.get("biases") or {}).get("queue") if mode == "add" and pman else None)
    ckpt_queue = queue  # the sample queries of the stage-1 tuning (raw rows; traffic may be mixed into `queue` below)
    tinfo = None
    if opts.defer_biases:  # fitted afterwards over a larger gallery by the caller (gare_build.shard_build)
        arrays["biases"], binfo = np.zeros(len(entries), np.float32), {"source": "deferred", "score": score}
    else:
        if mode == "add" and (pman.get("biases") or {}).get("traffic"):
            queue, tinfo = carried_traffic(queue, pman["biases"], prev.dim, report)
        arrays["biases"], binfo = compute_biases(arrays["units"], gamma, queue, opts.n_iters, served=served)
    binfo = {**binfo, "queue": qinfo}
    if tinfo is not None:
        binfo = traffic_binfo(binfo, tinfo)
    if binfo["source"] == "none":
        report.notes.append("the checkpoint has no text query queue: video biases are zero")
    # on validation captions, do the biases help this index's search, hence on by default (biases.default)?
    # (and which gamma fits them best: the chosen gamma's biases replace these; pipeline.biases.choose_gamma)
    b_chosen, binfo = with_default(
        binfo, p.model, arrays, [e.meta for e in entries], opts.ncl_val, pman if mode == "add" else None,
        refit=lambda g: compute_biases(arrays["units"], g, queue, opts.n_iters, served=served), factors=opts.ncl_gammas)
    if b_chosen is not None:
        arrays["biases"] = b_chosen
    report.biases = binfo
    report.ncl_stage1 = p.post["ncl_stage1"] is not None
    stage1 = arrays.get("ann_units", arrays["units"])
    ids = arrays["ids"]
    requested = opts.index_type or (pman.get("index_type_requested", "auto") if mode == "add" else "auto")
    t_ann = time.time()
    if mode == "add" and prev is not None:
        # the new ANN = the previous one - every id not kept + the new and changed clips
        drop = np.setdiff1d(np.asarray(prev.ids), kept_ids)
        new_rows = np.flatnonzero(np.isin(ids, todo_ids))
        ann, ainfo = make_ann(stage1, ids, opts, prev, requested, incremental=True,
                               drop_ids=drop, new_rows=new_rows)
    else:
        ann, ainfo = make_ann(stage1, ids, opts, None, requested, incremental=False,
                               drop_ids=np.zeros(0, np.int64), new_rows=np.zeros(0, np.int64))
    ann, ainfo = _tune_stage1(ann, ainfo, stage1, ids, arrays, p.model, ckpt_queue, opts, requested,
                              time.time() - t_ann, ncl_on=(index_ncl_default({"biases": binfo}) or (NCL_DEFAULT,))[0],
                              psi_fold=psi_fold)
    report.stage1 = ainfo.get(STAGE1_KEY)
    report.index_type = ann.params.index_type
    extra = {
        "checkpoint": {"path": str(p.ckpt_path), "sha256": p.sha, "model_config": cfg.to_dict()},
        "precision": p.precision,
        "sampling": {"max_frames": cfg.max_frames, "video_framerate": cfg.video_framerate, "image_size": cfg.image_size},
        "segment": {"seconds": p.segment, "overlap": p.overlap} if p.segment else None,
        "index_type_requested": requested,
        "biases": binfo,
        "next_id": int(max(p.next_id, int(ids.max()) + 1 if ids.size else 0)),
        "builder": {"command": mode, "engine": opts.engine},
        "invgc": invgc_m,
        "ncl_stage1": p.post["ncl_stage1"],
        **ainfo,
    }
    extra["psi_fold"] = psi_fold
    if p.fields:
        extra["fields"] = dict(p.fields)
    return write_version(p.root, arrays, [e.meta for e in entries], extra, ann=ann, keep=opts.keep)


def _tune_stage1(ann: AnnIndex, ainfo: dict[str, Any], units: Any, ids: np.ndarray, arrays: dict[str, Any],
                 model: Any, queue: np.ndarray | None, opts: BuildOptions, requested: str, build_s: float,
                 *, ncl_on: bool = NCL_DEFAULT, psi_fold: dict[str, Any] | None = None) -> tuple[AnnIndex, dict[str, Any]]:
    """Meet the recall target and choose the default K (gare_build.tuning.version_tuning); ainfo gains manifest["stage1"].
    K is chosen for the score served by default: psi + biases when ``ncl_on``, else psi alone (the biases can be off by default).
    ``psi_fold``: the manifest entry of the psi constants just attached (the coverage reads them)."""
    if not opts.stage1.enabled:
        return ann, {**ainfo, STAGE1_KEY: None}
    def arr(v: Any) -> Any:  # a fresh array, or the previous version's file (memmapped)
        return np.load(v.path, mmap_mode="r", allow_pickle=False) if isinstance(v, ExistingFile) else v

    caps = encode_captions(model, list(opts.tune_captions)) if opts.tune_captions else None
    stored = None
    if psi_fold and psi_consts.PSI_CONSTS_ARRAY in arrays:  # folded for this model a moment ago (psi_consts.attach)
        stored = StoredConsts(arr(arrays[psi_consts.PSI_CONSTS_ARRAY]), arr(arrays["units"]), arr(arrays["norms"]),
                              psi_fold["fingerprint"])
    tuned, entry = tune_version_ann(arr(units), ids, frames=arr(arrays["frames"]), masks=arr(arrays["masks"]),
                                    biases=arr(arrays["biases"]) if ncl_on else np.zeros(len(ids), np.float32), model=model, queue=queue, captions=caps, ann=ann,
                                    build_s=build_s, requested_type=requested, options=opts.stage1,
                                    progress=progress_enabled(opts.progress), stored=stored)
    same = tuned.cpu_index is ann.cpu_index
    return tuned, {**ainfo, "ann_params": tuned.params.to_dict(),
                   "ann_trained_n": ainfo.get("ann_trained_n") if same else int(units.shape[0]),
                   STAGE1_KEY: {**entry, "ncl_default": ncl_on} if entry else entry}
