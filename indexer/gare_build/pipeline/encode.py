"""Stage 2 of build/add, encoding: clips -> frame features with the model, on the local or the Dask engine.

One module for encoding: the per-process model cache (:func:`cached_model`, checked by sha256), the batch encoder
(:func:`encode_batch`, one collate_clips batch -> a shard of features) that both engines run, the Dask task
(:func:`encode_shard`), the :class:`Encoder` that runs the plan's jobs (every finished batch goes to the work/
cache), and :func:`collect_entries`, which turns the plan into entries of the new version, dropping every window of
a video that failed or changed while it was being indexed (nothing partial enters).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from gare.checkpoint import file_sha256, load_model
from gare.model import autocast, resolve_device
from gare.video import normalize_frames
from gare.video_loader import decode_batch_size, iter_decoded
from gare_build.dask_engine import run_dask
from gare_build.discover import Clip, seg_of
from gare_build.pipeline.assemble import Entry
from gare_build.pipeline.options import BuildOptions, RunReport
from gare_build.pipeline.plan import Job, Plan, skip_record
from gare_build.resumable_work import Shard, WorkCache
from gare_index.store import test_pause

log = logging.getLogger(__name__)

_MODELS: dict[tuple[str, str, str], Any] = {}
_MODELS_LOCK = threading.Lock()


def cached_model(checkpoint: str, sha256: str, device: str = "auto") -> tuple[Any, torch.device]:
    """Load a checkpoint once per process (Dask workers call this for every task).

    The file's sha256 must equal `sha256`: a worker that sees another file under the same path (no shared
    filesystem, a stale copy) fails instead of producing features of another model.
    """
    dev = resolve_device(device)
    key = (str(checkpoint), sha256, str(dev))
    with _MODELS_LOCK:
        hit = _MODELS.get(key)
        if hit is None:
            have = file_sha256(checkpoint)
            if have != sha256:
                raise RuntimeError(f"checkpoint {checkpoint} on this worker has sha256 {have}, expected {sha256}")
            model, _ = load_model(checkpoint, dev)
            hit = _MODELS[key] = model
    return hit, dev


@torch.no_grad()
def encode_batch(model: Any, device: torch.device, precision: str, batch: dict[str, Any]) -> tuple[Shard | None, dict[str, str], int]:
    """Encode one collate_clips batch -> (shard of good clips or None, {key: reason} failures, frames used).

    The padded rows are whatever `model.encode_video` returns: zero for models trained here, the encoder's
    features (and v̄ the mean over all rows) for a checkpoint with `cfg.reference_padding`; both are stored as is.
    """
    keys = list(batch["keys"])
    if not keys:
        return None, {}, 0
    frames = batch["frames"]
    if frames.dtype == torch.uint8:  # iter_decoded(as_uint8=True): normalised here, on the encoder's device
        frames = normalize_frames(frames.to(device), batch["mask"])
    with autocast(device, precision):
        feats, vbar = model.encode_video(frames, batch["mask"])
    feats = feats.float().cpu().numpy()
    vbar = vbar.float().cpu().numpy()
    masks = batch["mask"].cpu().numpy().astype(np.uint8)
    norms = np.linalg.norm(vbar.astype(np.float64), axis=1)
    good = np.isfinite(feats).all(axis=(1, 2)) & np.isfinite(vbar).all(axis=1) & (norms > 1e-12)
    failed = {k: "the encoder produced a zero or non-finite embedding" for k, g in zip(keys, good, strict=True) if not g}
    if not good.any():
        return None, failed, 0
    f16 = feats[good].astype(np.float16)
    if not np.isfinite(f16).all():  # float16 overflow (|x| > 65504): a broken model, not a broken file
        raise RuntimeError("frame features overflow float16; the checkpoint produces values above 65504")
    shard = Shard([k for k, g in zip(keys, good, strict=True) if g], f16, vbar[good].astype(np.float32), masks[good])
    return shard, failed, int(masks[good].sum())


def encode_shard(
    items: Sequence[tuple[str, str, float | None, float | None]],
    checkpoint: str,
    sha256: str,
    device: str,
    precision: str,
    batch_size: int,
    decode_timeout: float = 300.0,
) -> dict[str, Any]:
    """The Dask engine's task, run on a worker: decode (in the worker process) and encode `items`; returns the
    features (:func:`gare_build.dask_engine.run_dask` submits it per shard)."""
    model, dev = cached_model(checkpoint, sha256, device)
    cfg = model.cfg
    keys: list[str] = []
    frames, vbars, masks = [], [], []
    failed: dict[str, str] = {}
    n_frames = 0
    # num_workers=0: a Dask worker may be a daemon process, which cannot start DataLoader workers.
    for batch in iter_decoded(
        list(items), max_frames=cfg.max_frames, framerate=cfg.video_framerate, image_size=cfg.image_size,
        batch_size=batch_size, num_workers=0, timeout=decode_timeout, as_uint8=True,
    ):
        failed.update({k: r for k, r in batch["failed"]})
        shard, bad, nf = encode_batch(model, dev, precision, batch)
        failed.update(bad)
        if shard is not None:
            keys += shard.keys
            frames.append(shard.frames)
            vbars.append(shard.vbar)
            masks.append(shard.masks)
            n_frames += nf
    d, f = cfg.embed_dim, cfg.max_frames
    return {
        "keys": keys,
        "frames": np.concatenate(frames) if frames else np.zeros((0, f, d), np.float16),
        "vbar": np.concatenate(vbars) if vbars else np.zeros((0, d), np.float32),
        "masks": np.concatenate(masks) if masks else np.zeros((0, f), np.uint8),
        "failed": failed,
        "frames_used": n_frames,
        "worker": os.getpid(),
    }


def kv_fn(model: Any) -> Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """The K/V of stored frames (float16), for an index that keeps them (``add`` to such an index)."""
    @torch.no_grad()
    def fn(frames16: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        fr = torch.from_numpy(np.asarray(frames16, dtype=np.float32)).to(model.device)
        k, v = model.video_kv(fr)
        return k.float().cpu().numpy().astype(np.float16), v.float().cpu().numpy().astype(np.float16)

    return fn


def _meta_row(c: Clip, frames_used: int) -> dict[str, Any]:
    return {
        "id": int(c.id), "path": c.path, "size": int(c.size), "mtime": float(c.mtime), "checksum": c.checksum,
        "duration": c.duration, "fps": c.fps, "frames_used": int(frames_used), "start": c.start, "end": c.end,
        "status": "ok",
    }


class Encoder:
    """Runs the jobs through the local or Dask engine; every finished batch goes to the work cache."""

    def __init__(self, *, cache: WorkCache, report: RunReport, opts: BuildOptions, progress: bool) -> None:
        self.cache, self.report, self.opts = cache, report, opts
        self.failed: dict[str, str] = {}
        self.progress = progress
        self._pbar = None
        self._t0 = 0.0

    def _record(self, shard: Shard | None, failed: dict[str, str], frames_used: int, done: int) -> None:
        self.failed.update(failed)
        before = self.report.encoded
        if shard is not None and shard.keys:
            self.cache.put(shard)
            self.report.encoded += len(shard.keys)
            self.report.frames_encoded += frames_used
        if self._pbar is not None:
            self._pbar.update(done)
            el = max(time.time() - self._t0, 1e-9)
            self._pbar.set_postfix_str(f"{self.report.frames_encoded / el:.1f} frames/s, {len(self.failed)} failed")
        for c in range(before + 1, self.report.encoded + 1):
            test_pause(f"encoded:{c}")

    def run(self, jobs: list[Job], *, model: Any, device: Any,
            precision: str, checkpoint: str, sha256: str) -> None:
        if not jobs:
            return
        from tqdm.auto import tqdm

        self._t0 = time.time()
        self._pbar = tqdm(total=len(jobs), unit="video", desc="encode", disable=not self.progress, dynamic_ncols=True,
                          file=sys.stderr)
        try:
            if self.opts.engine == "dask":
                def on_result(res: dict[str, Any]) -> None:
                    shard = Shard(res["keys"], res["frames"], res["vbar"], res["masks"]) if res["keys"] else None
                    self._record(shard, res["failed"], res["frames_used"], len(res["keys"]) + len(res["failed"]))

                run_dask(
                    encode_shard, jobs, checkpoint=checkpoint, sha256=sha256, device=self.opts.device, precision=precision,
                    batch_size=self.opts.batch_size, shard_size=self.opts.shard_size, scheduler=self.opts.scheduler,
                    n_workers=self.opts.dask_workers, on_result=on_result, decode_timeout=self.opts.decode_timeout,
                )
            else:
                cfg = model.cfg
                for batch in iter_decoded(
                    jobs, max_frames=cfg.max_frames, framerate=cfg.video_framerate, image_size=cfg.image_size,
                    batch_size=decode_batch_size(len(jobs), self.opts.batch_size, self.opts.workers),
                    num_workers=self.opts.workers, timeout=self.opts.decode_timeout, as_uint8=True,
                ):
                    failed = {k: r for k, r in batch["failed"]}
                    shard, bad, nf = encode_batch(model, device, precision, batch)
                    failed.update(bad)
                    self._record(shard, failed, nf, len(batch["keys"]) + len(batch["failed"]))
        finally:
            self.report.encode_s = round(time.time() - self._t0, 3)
            self._pbar.close()
            self._pbar = None
        el = max(self.report.encode_s, 1e-9)
        self.report.videos_per_s = round(self.report.encoded / el, 3)
        self.report.frames_per_s = round(self.report.frames_encoded / el, 3)


def collect_entries(p: Plan, enc: Encoder, report: RunReport) -> tuple[list[Entry], np.ndarray, np.ndarray, int]:
    """The entries of the new version, sorted by id, after encoding: (entries, ids of the new and changed clips,
    ids kept from the current version, number of new and changed clips). Fills report's counters/skipped."""
    todo, jobs, prev = p.todo, p.jobs, p.prev
    # ---- drop failures (every window of a video with a failed window: nothing partial enters)
    stat_changed: set[str] = set()
    first_clip: dict[str, Clip] = {}
    for c in todo:
        first_clip.setdefault(c.path, c)
    for path in {jobs[k][1] for k in jobs if k not in enc.failed}:
        c0 = first_clip[path]
        try:
            st = os.stat(path)
            if int(st.st_size) != c0.size or float(st.st_mtime) != c0.mtime:
                stat_changed.add(path)
        except OSError:
            stat_changed.add(path)
    bad_paths: dict[str, str] = {}
    for c in todo:
        if c.cache_key in enc.failed:
            bad_paths.setdefault(c.path, enc.failed[c.cache_key])
        elif c.path in stat_changed:
            bad_paths.setdefault(c.path, "file changed while it was being indexed")
    entries: list[Entry] = []
    cached = p.cache.index()
    prev_ids_by_seg = {seg_of(r["path"], r["start"], r["end"]): int(r["id"]) for r in p.prev_rows}
    n_from_todo = 0
    for c in todo:
        if c.path in bad_paths:
            reason = bad_paths[c.path] if c.cache_key in enc.failed or c.path in stat_changed else (
                f"another window of this video failed: {bad_paths[c.path]}")
            if p.mode == "add" and c.seg in prev_ids_by_seg:
                reason += " (its previous entry was removed)"
            report.skipped.append(skip_record(c, reason))
            continue
        k = c.cache_key
        if k in p.prev_by_key:
            src: tuple = ("prev", p.prev_by_key[k])
            report.from_index += 1
        else:
            shard_path, row = cached[k]
            src = ("shard", shard_path, row)
            if k not in jobs:
                report.from_cache += 1
        entries.append(Entry(_meta_row(c, 0), src))
        n_from_todo += 1
        if p.mode == "add" and c.seg in prev_ids_by_seg:
            report.updated += 1
        else:
            report.added += 1
    todo_ids = np.array(sorted(e.meta["id"] for e in entries), dtype=np.int64)
    kept_ids = np.array([r["id"] for r in p.kept], dtype=np.int64)
    kept_rows = prev.rows(kept_ids) if p.kept else []
    for r, row in zip(p.kept, kept_rows, strict=True):
        entries.append(Entry(dict(r), ("prev", int(row))))
    entries.sort(key=lambda e: e.meta["id"])
    return entries, todo_ids, kept_ids, n_from_todo
