"""NCL video biases (SPEC §5) of a gallery: from the fresh queue (the training captions re-encoded with the final
text tower) or the checkpoint's stale queue (the embeddings pushed during training), optionally mixed
with a bank of served queries (`biases --from-traffic`, :mod:`gare_build.ncl_queues`). Used by the finish stage of
build/add and by remove/biases."""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gare.annotations import load_dataset, load_manifest
from gare.checkpoint import file_sha256, load_model, read_checkpoint
from gare.sinkhorn import sinkhorn_biases
from gare_build.ncl_queues import (
    BIAS_QUEUES,
    DEFAULT_QUEUE_SIZE,
    FreshQueueUnavailable,
    fresh_rows,
    load_query_bank,
    mix_queues,
    served_norms,
    training_captions,
)
from gare_build.pipeline.options import RunReport
from gare_build.served_biases import (
    DEFAULT_BIAS_K,
    ValidationScores,
    ncl_decision,
    served_biases,
    validation_scores,
)
from gare_build.tuning.version_tuning import encode_captions
from gare_index import psi_consts
from gare_index.store import CheckpointRef, ExistingFile, IndexManifest, IndexMismatchError, IndexVersion

log = logging.getLogger(__name__)


def checkpoint_gamma_and_queue(ckpt: Any, *, raw: bool = False) -> tuple[float, np.ndarray | None]:
    """gamma = 1 / exp(logit_scale) and the text query queue (float32; unit rows, or as stored with `raw`: psi
    needs the un-normalised t) of a Checkpoint."""
    ls = ckpt.state_dict.get("clip.logit_scale")
    if ls is None:
        raise ValueError(f"{ckpt.path}: no clip.logit_scale in the checkpoint")
    gamma = float(1.0 / math.exp(float(ls.float().reshape(-1)[0])))
    q = ckpt.queues.get("text")
    if q is None or q.numel() == 0:
        return gamma, None
    q = q.float().reshape(q.shape[0], -1)
    if not raw:
        q = q / q.norm(dim=1, keepdim=True).clamp_min(1e-12)
    return gamma, q.numpy().astype(np.float32)


def bias_queue(ckpt: Any, model: Any, kind: str | None, captions: str | os.PathLike | None = None, *,
               prev: Mapping[str, Any] | None = None, report: RunReport | None = None
               ) -> tuple[float, np.ndarray | None, dict[str, Any]]:
    """gamma and the raw text queue (Q, d) NCL fits the biases to, and the manifest's ``biases.queue`` record.

    ``kind``: "fresh" re-encodes the training captions (:func:`gare_build.ncl_queues.training_captions`: ``captions``
    or the data the checkpoint names) with ``model``'s text tower, the final one, at most the checkpoint's queue size
    of them (a seeded sample beyond); "stale" takes the embeddings pushed into the checkpoint's queue during
    training, most of them by earlier states of the model. None: ``prev``'s record (an index's previous version),
    else fresh when the captions can be read, else stale with the reason in the record and the report. An
    explicit "fresh" whose captions cannot be read is an error naming them."""
    if kind is not None and kind not in BIAS_QUEUES:
        raise ValueError(f"--bias-queue must be one of {BIAS_QUEUES}, got {kind!r}")
    gamma, stale = checkpoint_gamma_and_queue(ckpt, raw=True)
    if kind is None and prev:
        kind, captions = prev.get("kind"), captions or prev.get("source")
    if kind == "stale":
        return gamma, stale, {"kind": "stale", "n": 0 if stale is None else int(stale.shape[0])}
    try:
        texts, info = training_captions(ckpt, captions)
    except FreshQueueUnavailable as e:
        if kind == "fresh":
            raise
        if report is not None:
            report.notes.append(f"NCL biases from the checkpoint's stale queue: no fresh queue ({e})")
        return gamma, stale, {"kind": "stale", "n": 0 if stale is None else int(stale.shape[0]), "fresh_unavailable": str(e)}
    if not texts:
        raise FreshQueueUnavailable(f"the fresh queue's captions ({info['captions']}) hold no caption")
    size = int((getattr(ckpt, "train_args", None) or {}).get("queue_size") or DEFAULT_QUEUE_SIZE)
    rows = fresh_rows(len(texts), size)
    t0 = time.time()
    q = encode_captions(model, [texts[i] for i in rows])
    log.info("fresh NCL queue: %d of %d training captions encoded in %.1fs", len(rows), len(texts), time.time() - t0)
    src = str(Path(captions).expanduser().absolute()) if captions is not None else None
    return gamma, q, {"kind": "fresh", "n": int(len(rows)), "n_captions": len(texts), "source": src, **info}


def compute_biases(units: np.ndarray, gamma: float, queue: np.ndarray | None, n_iters: int = 4,
                   device: str | None = None, *, served: dict[str, Any] | None = None) -> tuple[np.ndarray, dict[str, Any]]:
    """NCL video biases b (SPEC §5) of every indexed video against the checkpoint's text queue.

    `served`: fit them to the psi score the search ranks by (:func:`gare_build.served_biases.served_biases`; `queue` then holds the
    un-normalised t): a dict with model, norms, frames, masks, stage1 (optional) and k. Without it they are
    fitted to the dual-tower cosine (the queue rows are normalised here)."""
    n = units.shape[0]
    if queue is None or n == 0:
        info = {"gamma": gamma, "n_iters": n_iters, "n_queries": 0, "source": "none",
                "score": "served" if served is not None else "dual"}
        if queue is None:
            log.warning("the checkpoint has no text query queue: video biases are zero (no NCL correction)")
        return np.zeros(n, dtype=np.float32), info
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if queue.shape[1] != units.shape[1]:
        raise ValueError(f"the query queue has d={queue.shape[1]}, the index has d={units.shape[1]}")
    info = {"gamma": gamma, "n_iters": n_iters, "n_queries": int(queue.shape[0]), "source": "checkpoint-queue"}
    if served is not None:
        model = served["model"]
        with torch.no_grad():
            b_np, sinfo = served_biases(model, queue, gamma, units=units, norms=served["norms"], frames=served["frames"],
                                        masks=served["masks"], stage1=served.get("stage1"), n_iters=n_iters,
                                        k=int(served.get("k", 256)), device=dev if model.device.type == dev else None,
                                        consts=served.get("consts"))
        return b_np, {**info, "score": "served", "served": sinfo}
    unit_q = queue / np.maximum(np.linalg.norm(queue, axis=1, keepdims=True), 1e-12)
    t0 = time.time()
    _, b = sinkhorn_biases(torch.from_numpy(np.ascontiguousarray(unit_q, dtype=np.float32)), units, gamma,
                           n_iters=n_iters, device=dev)
    log.info("NCL biases for %d videos against %d queries in %.1fs", n, queue.shape[0], time.time() - t0)
    return b.numpy().astype(np.float32), {**info, "score": "dual"}


def bias_score_of(manifest: IndexManifest | Mapping[str, Any]) -> str:
    """The score an index's biases were fitted to (indexes written before the biases fitted the served score: the dual-tower cosine)."""
    return str((manifest.get("biases") or {}).get("score") or "dual")


def served_inputs(model: Any, arrays: dict[str, Any], k: int, *, consts_valid: bool = False) -> dict[str, Any]:
    """compute_biases(served=...) from a version's arrays (frames may be a staged file). ``consts_valid``: the
    arrays' ``psi_consts`` (when present) belong to model.psi, so the psi scores read them instead of folding."""
    def val(x: Any) -> Any:
        return np.load(x.path, mmap_mode="r") if isinstance(x, ExistingFile) else x

    st = val(arrays.get("ann_units"))
    consts = val(arrays.get("psi_consts")) if consts_valid else None
    return {"model": model, "norms": np.asarray(arrays["norms"]), "frames": val(arrays["frames"]),
            "masks": np.asarray(arrays["masks"]), "stage1": None if st is None else np.asarray(st, dtype=np.float32),
            "k": k, "consts": consts}


def traffic_binfo(binfo: dict[str, Any], tinfo: dict[str, Any]) -> dict[str, Any]:
    """The manifest's ``biases`` record of biases fitted to a queue with traffic mixed in (``tinfo``)."""
    out = dict(binfo)
    if out.get("source") != "none":
        out["source"] = "traffic" if tinfo.get("train_queries", 0) == 0 else "checkpoint-queue+traffic"
    out["traffic"] = tinfo
    return out


def _mixed_queue(queue: np.ndarray | None, bank_path: str | os.PathLike, weight: float, d: int
                 ) -> tuple[np.ndarray, dict[str, Any]]:
    bank, info = load_query_bank(bank_path, d)
    # psi needs the served |t|: rows of older banks are unit vectors, scaled to a reference norm (no effect on the
    # dual-tower biases, which normalise every row)
    ref = float(np.linalg.norm(queue, axis=1).mean()) if queue is not None and len(queue) else None
    bank, ninfo = served_norms(bank, ref)
    mixed, minfo = mix_queues(queue, bank, weight)
    return mixed, {**info, **minfo, **ninfo}


def carried_traffic(queue: np.ndarray | None, prev_binfo: dict[str, Any], d: int, report: RunReport
                     ) -> tuple[np.ndarray | None, dict[str, Any] | None]:
    """add/remove after `biases --from-traffic`: recompute with the same bank file when it is still readable,
    else fall back to the checkpoint's queue (and say so in the report)."""
    t = prev_binfo["traffic"]
    try:
        mixed, info = _mixed_queue(queue, t["file"], float(t["traffic_weight"]), d)
    except ValueError as e:
        report.notes.append(f"the biases came from the query bank {t.get('file')}, which cannot be used any more ({e}); "
                            "they were recomputed from the checkpoint's queue: run `gare-index biases --from-traffic` again")
        return queue, None
    if info["sha256"] != t.get("sha256"):
        report.notes.append(f"the query bank {t['file']} changed since the last `biases --from-traffic`; its current content was used")
    return mixed, info


def biases_for(prev: IndexVersion, arrays: dict[str, Any], checkpoint: str | os.PathLike | None, n_iters: int | None,
                *, traffic: str | os.PathLike | None = None, traffic_weight: float = 0.5,
                report: RunReport | None = None, carry_traffic: bool = False, score: str | None = None,
                k: int | None = None, queue_kind: str | None = None, captions: str | os.PathLike | None = None,
                ncl_val: str | os.PathLike | None = None, metas: list[Mapping[str, Any]] | None = None,
                gamma_factors: Sequence[float] | None = None) -> tuple[np.ndarray, dict[str, Any]]:
    """Recompute the biases of a gallery (`arrays`: units, norms, frames, masks, optional ann_units) with the
    index's checkpoint (its queue and logit scale), mixed with a bank of served queries when `traffic` is given
    (or when the previous biases came from one: remove). `score`/`k`: default the previous version's;
    `queue_kind`/`captions`: the queue (:func:`bias_queue`; default the previous version's, else fresh);
    `ncl_val`: validation captions deciding the index's NCL default (:func:`with_default`; default the previous
    version's, when it had a decision); `metas`: the gallery's rows in order (path, start, end) that the validation
    captions are matched to, default ``prev``'s rows of ``arrays["ids"]`` (a sharded root's global fit: every shard's);
    `gamma_factors`: gamma is chosen among these multiples of the checkpoint's on the validation captions
    (:func:`with_default`; default the previous decision's, else GAMMA_FACTORS)."""
    units = np.asarray(arrays["units"], dtype=np.float32)
    score = score or bias_score_of(prev.manifest)
    if score not in ("served", "dual"):
        raise ValueError(f"--bias-score must be served or dual, got {score!r}")
    pb = prev.manifest.biases  # the previous version's record (an open JSON object)
    k = k or int((pb.get("served") or {}).get("k") or 256)

    ck = prev.manifest.checkpoint or CheckpointRef()
    iters = n_iters or int(pb.get("n_iters") or 4)
    path = Path(checkpoint).expanduser().absolute() if checkpoint else Path(ck.path or "")
    if traffic is not None:  # validate the bank before anything else: a bad file changes nothing
        load_query_bank(traffic, prev.dim)
    if not path.is_file():
        if pb.get("source") == "none" and not checkpoint and traffic is None:
            info = dict(pb, n_iters=iters)
            return np.zeros(units.shape[0], np.float32), info
        raise ValueError(f"cannot recompute the NCL biases: checkpoint {path} not found; pass --checkpoint")
    sha = file_sha256(path)
    if ck.sha256 and sha != ck.sha256:
        raise IndexMismatchError(
            f"index {prev.root} was built with checkpoint sha256 {ck.sha256} ({ck.path}); {path} has sha256 {sha}"
        )
    ckpt = read_checkpoint(path)
    model = None
    want_fresh = queue_kind == "fresh" or (queue_kind is None and (pb.get("queue") or {}).get("kind", "fresh") == "fresh")
    if score == "served" and len(units) or want_fresh:
        model, _ = load_model(path, "cuda" if torch.cuda.is_available() else "cpu")
    # indexes from before the fresh queue have no queue record: they used the stale queue, which `biases` now refreshes
    gamma, queue, qinfo = bias_queue(ckpt, model, queue_kind, captions, prev=pb.get("queue"), report=report)
    tinfo = None
    if traffic is not None:
        queue, tinfo = _mixed_queue(queue, traffic, traffic_weight, prev.dim)
    elif carry_traffic and pb.get("traffic") and report is not None:
        queue, tinfo = carried_traffic(queue, pb, prev.dim, report)
    served = None
    if score == "served" and queue is not None and len(units):
        # the previous version's constants, when they belong to this checkpoint's psi (same sha checked above)
        valid = arrays.get("psi_consts") is not None and psi_consts.fold_status(prev, psi_consts.fold_of(model)) is None
        served = served_inputs(model, arrays, k, consts_valid=valid)
    b, info = compute_biases(units, gamma, queue, iters, served=served)
    info["queue"] = qinfo
    info = info if tinfo is None else traffic_binfo(info, tinfo)
    if ncl_val or (pb.get("default") or {}).get("source"):
        if model is None:
            model, _ = load_model(path, "cuda" if torch.cuda.is_available() else "cpu")
        if metas is None:  # the new gallery's rows (remove: the kept ones)
            metas = prev.metadata(np.asarray(arrays.get("ids", prev.ids)))
        b_chosen, info = with_default(info, model, {**arrays, "biases": b}, metas, ncl_val, {"biases": pb},
                                      refit=lambda g: compute_biases(units, g, queue, iters, served=served),
                                      factors=gamma_factors)
        if b_chosen is not None:
            b = b_chosen
    return b, info


# ------------------------------------------------------------------ the per-index default (biases on or off)
def _window(x: Any) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else round(float(x), 3)


def validation_set(source: str | os.PathLike, metas: list[Mapping[str, Any]]) -> tuple[list[str], np.ndarray, str]:
    """Validation captions whose videos are in the gallery: (captions, their gallery rows, a description).

    ``source``: a caption manifest (.csv / .jsonl, used whole) or a `gare-train synth` folder (its test split, as
    --tune-captions). ``metas``: the gallery's rows in order (path, start, end). A caption is matched to the row
    with the same absolute path and window; captions of videos not indexed are left out (counted)."""
    p = Path(source).expanduser().absolute()
    if p.is_file():
        rs = load_manifest(p, name="ncl-val")
    elif p.is_dir() and (p / "test.csv").is_file() and (p / "MSRVTT_data.json").is_file():
        rs = load_dataset({"kind": "synth", "root": str(p)}, "test")
    else:
        raise ValueError(f"--ncl-val {source}: not a caption manifest (.csv/.jsonl) or a `gare-train synth` folder")
    # real paths on both sides: a caption file may name a video through a symlink the index did not
    where = {(os.path.realpath(m["path"]), _window(m.get("start")), _window(m.get("end"))): i for i, m in enumerate(metas)}
    caps, rows, missing = [], [], 0
    for text, ci in zip(rs.captions, rs.caption_clip, strict=True):
        c = rs.clips[int(ci)]
        row = where.get((os.path.realpath(c.path), _window(c.start), _window(c.end)))
        if row is None:
            missing += 1
            continue
        caps.append(text)
        rows.append(row)
    desc = f"{'manifest' if p.is_file() else 'synth test split'} {p.name}" + (f"; {missing} captions of videos not in the index left out" if missing else "")
    return caps, np.asarray(rows, dtype=np.int64), desc


# gamma (the Sinkhorn temperature of SPEC §5) is chosen among these multiples of the checkpoint's 1 / exp(logit_scale)
GAMMA_FACTORS = (0.25, 0.5, 1.0, 2.0, 4.0)
MIN_CHOOSE = 10  # captions in each half before gamma is chosen on one half and the default decided on the other

Refit = Callable[[float], tuple[np.ndarray, dict[str, Any]]]  # gamma -> (biases (n,), their record)


def _val(x: Any) -> Any:
    return np.load(x.path, mmap_mode="r") if isinstance(x, ExistingFile) else x


def _scores(model: Any, arrays: Mapping[str, Any], caps: list[str], rows: np.ndarray, k: int) -> ValidationScores:
    st, consts = arrays.get("ann_units"), arrays.get("psi_consts")
    return validation_scores(model, encode_captions(model, caps), rows, units=_val(arrays["units"]),
                             norms=np.asarray(_val(arrays["norms"])), frames=_val(arrays["frames"]),
                             masks=np.asarray(_val(arrays["masks"])),
                             stage1=None if st is None else np.asarray(_val(st), dtype=np.float32), k=k,
                             consts=None if consts is None else _val(consts))


def choose_gamma(vs: ValidationScores, rows: np.ndarray, gamma0: float, fit: Refit, factors: Sequence[float]
                 ) -> tuple[float, np.ndarray, dict[str, Any], dict[str, Any]]:
    """The gamma among ``gamma0`` x ``factors`` whose biases rank the captions at ``rows`` best (R@1, then R@5,
    then the closest to ``gamma0``): (gamma, its biases, their record, the choice's record with every candidate)."""
    tried, best = [], None
    for f in sorted(set(float(x) for x in factors)):
        g = gamma0 * f
        b, info = fit(g)
        r = vs.ranks(b, rows)
        r1, r5 = float(100.0 * np.mean(r <= 1)), float(100.0 * np.mean(r <= 5))
        tried.append({"gamma": g, "factor": f, "R1": round(r1, 4), "R5": round(r5, 4)})
        key = (r1, r5, -abs(math.log(f)))
        if best is None or key > best[0]:
            best = (key, g, b, info)
    assert best is not None
    _, g, b, info = best
    return g, b, info, {"chosen": g, "checkpoint_gamma": gamma0, "factors": sorted(set(float(x) for x in factors)),
                        "n_captions": int(len(rows)), "tried": tried,
                        "rule": "best t2v R@1, then R@5, then the nearest to the checkpoint's gamma"}


def decide_default(model: Any, arrays: Mapping[str, Any], metas: list[Mapping[str, Any]], source: str | os.PathLike,
                   k: int, *, refit: Refit | None = None, gamma0: float | None = None,
                   factors: Sequence[float] = GAMMA_FACTORS
                   ) -> tuple[tuple[np.ndarray, dict[str, Any]] | None, dict[str, Any]]:
    """The index's NCL default (``biases.default`` in the manifest): psi vs psi + the version's biases on the
    validation captions of ``source`` through the served search (stage-1 top ``k``, psi, + b), decided by
    :func:`gare_build.served_biases.ncl_decision`; records the source so add can decide again.

    With ``refit`` (gamma -> biases) and at least 2 x MIN_CHOOSE captions, gamma is chosen too
    (:func:`choose_gamma`) on the even captions and the default decided on the odd ones: the decision never sees
    the captions that picked gamma. Returns ((the chosen gamma's biases, their record) or None when gamma was not
    chosen, the decision's record)."""
    caps, rows, desc = validation_set(source, metas)
    t0 = time.time()
    new_b, new_info, choice = None, None, None
    if caps:
        vs = _scores(model, arrays, caps, rows, k)
        every = np.arange(len(caps))
        decide_on = every
        fs = sorted(set(float(x) for x in factors))
        if refit is not None and gamma0 is not None and len(fs) > 1 and len(caps) >= 2 * MIN_CHOOSE:
            gamma, new_b, new_info, choice = choose_gamma(vs, every[0::2], gamma0, refit, fs)
            decide_on = every[1::2]
            desc += f"; the odd {len(decide_on)} of them (gamma {gamma:.4g} was chosen on the even {len(caps) - len(decide_on)})"
        elif refit is not None and gamma0 is not None:  # nothing to choose on: one factor, or too few captions
            f = fs[0] if len(fs) == 1 else 1.0
            why = "the one factor given" if len(fs) == 1 else f"fewer than {2 * MIN_CHOOSE} validation captions to choose on"
            if f != 1.0:
                new_b, new_info = refit(gamma0 * f)
            choice = {"chosen": gamma0 * f, "checkpoint_gamma": gamma0, "factors": fs, "n_captions": len(caps),
                      "rule": f"not chosen: {why}"}
        b = new_b if new_b is not None else np.asarray(_val(arrays["biases"]))
        r_psi, r_b = vs.ranks(None, decide_on), vs.ranks(b, decide_on)
    else:
        r_psi = r_b = np.zeros(0, np.int64)
    dec = ncl_decision(r_psi, r_b, desc)
    if choice is not None:
        dec["gamma"] = choice
    log.info("%s (%.1fs)", dec["reason"], time.time() - t0)
    rec = {**dec, "source": str(Path(source).expanduser().absolute()), "k": int(k)}
    return (None if new_b is None or new_info is None else (new_b, new_info)), rec


def with_default(binfo: dict[str, Any], model: Any, arrays: Mapping[str, Any], metas: list[Mapping[str, Any]],
                 source: str | os.PathLike | None, prev: Mapping[str, Any] | None = None, *,
                 refit: Refit | None = None, factors: Sequence[float] | None = None
                 ) -> tuple[np.ndarray | None, dict[str, Any]]:
    """``binfo`` with its ``default`` decided (:func:`decide_default`) on ``source``, or on the validation captions
    the previous version decided on (add/remove keep deciding); unchanged when there are none or no biases.

    With ``refit``, gamma is chosen on the validation captions as well: returns the chosen gamma's biases (None
    when the biases stay as given) and the record, whose ``gamma`` (and ``served``) are then the chosen fit's.
    ``factors``: default the previous decision's (add/remove/biases keep choosing as the build did), else
    GAMMA_FACTORS."""
    prev_default = ((prev or {}).get("biases") or {}).get("default") or {}
    src = source or prev_default.get("source")
    if factors is None:
        factors = tuple((prev_default.get("gamma") or {}).get("factors") or GAMMA_FACTORS)
    if not src or binfo.get("source") in ("none", "deferred"):
        return None, binfo
    g0 = binfo.get("gamma")
    chosen, dec = decide_default(model, arrays, metas, src, DEFAULT_BIAS_K, refit=refit,
                                 gamma0=None if g0 is None else float(g0), factors=factors)
    out = {**binfo, "default": dec}
    if chosen is None:
        return None, out
    b, info = chosen
    out["gamma"] = float(dec["gamma"]["chosen"])
    if "served" in info:  # the served fit's own record (its K, seconds) belongs to the chosen gamma
        out["served"] = info["served"]
    return b, out
