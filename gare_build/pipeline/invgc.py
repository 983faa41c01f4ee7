"""The optional post-processing of a build/add run: which of InvGC (stage-1 vectors) and the NCL fold of stage 1
apply, the (r_g, r_q) search of a new InvGC build, and the InvGC-corrected stage-1 vectors."""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from gare_build.pipeline.assemble import _Entry
from gare_build.pipeline.options import BuildOptions
from gare_index.store import IndexMismatchError, IndexVersion

log = logging.getLogger(__name__)


def _postprocess_setup(opts: BuildOptions, mode: str, pman: dict[str, Any], model: Any, ckpt: Any,
                       precision: str) -> dict[str, Any]:
    """What post-processing this run applies; for a new InvGC build, the (r_g, r_q) search runs here, before
    anything is encoded (a missing validation set fails the run early)."""
    from gare_build.invgc_select import select_invgc
    from gare_build.postprocess import invgc_refs

    if mode == "add":
        inv_prev, ncl_prev = pman.get("invgc"), pman.get("ncl_stage1")
        if opts.invgc is not None and bool(opts.invgc) != bool(inv_prev):
            raise ValueError(f"the index was built {'with' if inv_prev else 'without'} --invgc; add keeps it "
                             "(rebuild with `gare-index build` to change it)")
        if opts.invgc_r_g is not None or opts.invgc_val is not None:
            raise ValueError("add corrects new videos with the InvGC values recorded in the index; "
                             "--invgc-val/--invgc-r-g/--invgc-r-q are for build")
        if opts.ncl_stage1 is not None and bool(opts.ncl_stage1) != bool(ncl_prev):
            raise ValueError(f"the index was built {'with' if ncl_prev else 'without'} --ncl-stage1; add keeps it "
                             "(rebuild with `gare-index build` to change it)")
        post: dict[str, Any] = {"invgc": dict(inv_prev) if inv_prev else None,
                                "ncl_stage1": {"c": float(ncl_prev.get("c", 1.0))} if ncl_prev else None}
        if post["invgc"]:
            post["refs"] = invgc_refs(ckpt)
        return post
    if not opts.invgc and (opts.invgc_r_g is not None or opts.invgc_val is not None):
        raise ValueError("--invgc-val / --invgc-r-g / --invgc-r-q need --invgc")
    post = {"invgc": None, "ncl_stage1": {"c": float(opts.ncl_c)} if opts.ncl_stage1 else None}
    if opts.invgc:
        refs = invgc_refs(ckpt)
        if opts.invgc_r_g is not None:
            sel: dict[str, Any] = {"method": "given", "r_g": float(opts.invgc_r_g), "r_q": float(opts.invgc_r_q)}
        else:
            t0 = time.time()
            sel = select_invgc(model, ckpt, opts.invgc_val, k_percent=opts.invgc_k, grid=opts.invgc_grid,
                               precision=precision, batch_size=opts.batch_size, num_workers=opts.workers, refs=refs)
            sel["seconds"] = round(time.time() - t0, 3)
        post["invgc"] = {"r_g": float(sel["r_g"]), "r_q": float(sel["r_q"]), "k_percent": float(opts.invgc_k),
                         "selection": sel, "n_train_videos": int(refs[0].shape[0]), "n_train_queries": int(refs[1].shape[0])}
        post["refs"] = refs
    return post


def _invgc_vectors(units: np.ndarray, entries: list[_Entry], prev: IndexVersion | None, mode: str,
                   post: dict[str, Any]) -> tuple[np.ndarray, dict[str, Any]]:
    """The InvGC-corrected stage-1 vectors of every entry and the manifest's `invgc` record.

    build: LocalAdj's centring means come from this gallery (the result is gare.invgc.invgc of the
    units) and are recorded. add: rows carried from the previous version keep their vectors; new ones are
    corrected with the recorded r_g, r_q, k and means (the correction of an item depends only on the item)."""
    from gare_build.postprocess import invgc_apply, invgc_means

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
