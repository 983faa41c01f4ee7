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
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
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


@dataclass
class EncodeStages:
    """Where the local engine's encode loop spends its time: seconds summed over the batches, from a few clock reads
    per batch (on CUDA, events read once the batch's features are back on the host, which the loop waits for anyway:
    no extra synchronisation). ``RunReport.encode_stages`` carries :meth:`to_dict`.

    The loop overlaps three things: the decode workers (processes) decode the next batches while the device encodes
    one batch and a background thread writes the previous one to the work cache. So the parts do not add up to
    ``loop_s``; the one that is close to ``loop_s`` is the bottleneck: ``wait_s`` (the encoder waited for decoded
    batches: decode-bound), ``device_s`` (transfer + encode + copy back: encoder-bound) or ``write_s``.
    """

    workers: int = 0  # decode worker processes (0: decoded in this process, inside wait_s)
    batches: int = 0
    videos: int = 0
    frames: int = 0  # real (unpadded) frames decoded
    loop_s: float = 0.0  # wall seconds of the whole loop (worker start to the last write)
    first_batch_s: float | None = None  # loop start to the first decoded batch: worker start + one batch's decode
    wait_s: float = 0.0  # the loop blocked on the decode workers for the next batch (first_batch_s included)
    transfer_s: float = 0.0  # uint8 frames and masks host -> device (CUDA; 0 on the CPU: nothing crosses)
    encode_s: float = 0.0  # normalise + vision tower + temporal module on the device
    to_host_s: float = 0.0  # features and v-bar device -> host
    host_s: float = 0.0  # the loop's own host work per batch: pinning, submitting, checks, float16 conversion
    write_s: float = 0.0  # work-cache writes (atomic npz + fsync), in the writer thread
    decode_s: float = 0.0  # decode + collate wall seconds summed over the workers' batches (worker-side clocks)
    decode_cpu_s: float = 0.0  # the same in CPU seconds of the workers (< decode_s: the workers waited for a core)
    timed_on: str = "cpu"  # "cuda events" | "cpu" (perf_counter around synchronous ops)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        r = lambda x: None if x is None else round(float(x), 4)  # noqa: E731
        out: dict[str, Any] = {k: (r(v) if isinstance(v, float) else v) for k, v in self.__dict__.items() if k != "extra"}
        dev = self.transfer_s + self.encode_s + self.to_host_s
        out["device_s"] = r(dev)
        out["frames_per_s"] = r(self.frames / self.loop_s) if self.loop_s > 0 else None
        # one worker's decode rate, and what all of them would reach if nothing else limited them
        rate = self.frames / self.decode_s if self.decode_s > 0 else None
        out["decode_frames_per_s_per_worker"] = r(rate)
        out["decode_frames_per_s_all_workers"] = r(rate * self.workers) if rate is not None and self.workers else None
        out["encode_frames_per_s"] = r(self.frames / dev) if dev > 0 else None  # the device alone, back to back
        out["share_waiting"] = r(self.wait_s / self.loop_s) if self.loop_s > 0 else None
        out["share_device"] = r(dev / self.loop_s) if self.loop_s > 0 else None
        return out | self.extra

    def line(self) -> str:
        """One log/summary line: where the loop's time went."""
        d = self.to_dict()
        s = (f"encode loop {self.loop_s:.2f}s over {self.batches} batches: waited {self.wait_s:.2f}s for decoded batches "
             f"(first after {self.first_batch_s or 0.0:.2f}s), device {d['device_s']:.2f}s (transfer {self.transfer_s:.2f}, "
             f"encode {self.encode_s:.2f}, back {self.to_host_s:.2f}), host {self.host_s:.2f}s, cache writes "
             f"{self.write_s:.2f}s")
        if d["decode_frames_per_s_per_worker"] is not None:
            s += (f"; decode {d['decode_frames_per_s_per_worker']:.0f} frames/s per worker x {self.workers} workers "
                  f"(cpu/wall {self.decode_cpu_s / max(self.decode_s, 1e-9):.2f})")
        return s


@dataclass
class _Submitted:
    """One batch on its way through the device: the host copies of its outputs are valid once ``done`` (a CUDA
    event, or None on the CPU) has completed."""

    keys: list[str]
    mask: torch.Tensor  # (b, f) int64, host
    feats: torch.Tensor  # (b, f, d) float32, host (pinned on CUDA, filled asynchronously)
    vbar: torch.Tensor  # (b, d) float32, host
    events: list[Any] | None  # CUDA: [start, copied in, encoded, copied back]


def submit_batch(model: Any, device: torch.device, precision: str, batch: dict[str, Any],
                 stages: EncodeStages | None = None) -> _Submitted | None:
    """Queue one collate_clips batch on the encoder's device (None for a batch without good clips).

    On CUDA nothing here waits for the device: the uint8 frames go from pinned memory with non_blocking copies and
    the features come back into pinned memory the same way, so the caller can fetch the next decoded batch while
    this one is encoded; :func:`finish_batch` waits. On the CPU every op runs here, synchronously. The arithmetic is
    the same either way (copies move bits, they do not change them).
    """
    keys = list(batch["keys"])
    if not keys:
        return None
    frames, mask = batch["frames"], batch["mask"]
    cuda = device.type == "cuda"
    events = [torch.cuda.Event(enable_timing=True) for _ in range(4)] if cuda and stages is not None else None
    stream = torch.cuda.current_stream(device) if events else None  # the stream this batch's work goes to
    t0 = time.perf_counter()
    if events:
        events[0].record(stream)
    if cuda:  # pinned host memory: the copy is a DMA that does not hold this thread
        frames = frames.pin_memory().to(device, non_blocking=True)  # (b, f, 3, S, S) uint8 (or float32)
        mask_dev = mask.pin_memory().to(device, non_blocking=True)  # (b, f) int64
    else:
        mask_dev = mask
    t1 = time.perf_counter()
    if events:
        events[1].record(stream)
    if frames.dtype == torch.uint8:  # iter_decoded(as_uint8=True): normalised here, on the encoder's device
        frames = normalize_frames(frames.to(device), mask_dev)
    with autocast(device, precision):
        feats, vbar = model.encode_video(frames, mask_dev)
    feats, vbar = feats.float(), vbar.float()
    t2 = time.perf_counter()
    if events:
        events[2].record(stream)
        feats = feats.to("cpu", non_blocking=True)  # pinned host tensors (non_blocking device -> host copies pin)
        vbar = vbar.to("cpu", non_blocking=True)
        events[3].record(stream)
    else:
        feats, vbar = feats.cpu(), vbar.cpu()
    t3 = time.perf_counter()
    if stages is not None:
        if events:
            stages.host_s += t3 - t0  # the device's own times are read from the events in finish_batch
        else:
            stages.transfer_s += t1 - t0
            stages.encode_s += t2 - t1
            stages.to_host_s += t3 - t2
    return _Submitted(keys, mask, feats, vbar, events)


def finish_batch(sub: _Submitted | None, stages: EncodeStages | None = None) -> tuple[Shard | None, dict[str, str], int]:
    """Wait for a submitted batch -> (shard of good clips or None, {key: reason} failures, frames used)."""
    if sub is None:
        return None, {}, 0
    t0 = time.perf_counter()
    if sub.events:
        sub.events[3].synchronize()
        if stages is not None:
            stages.transfer_s += sub.events[0].elapsed_time(sub.events[1]) / 1e3
            stages.encode_s += sub.events[1].elapsed_time(sub.events[2]) / 1e3
            stages.to_host_s += sub.events[2].elapsed_time(sub.events[3]) / 1e3
    t1 = time.perf_counter()
    keys = sub.keys
    feats = sub.feats.numpy()
    vbar = sub.vbar.numpy()
    masks = sub.mask.numpy().astype(np.uint8)
    norms = np.linalg.norm(vbar.astype(np.float64), axis=1)
    good = np.isfinite(feats).all(axis=(1, 2)) & np.isfinite(vbar).all(axis=1) & (norms > 1e-12)
    failed = {k: "the encoder produced a zero or non-finite embedding" for k, g in zip(keys, good, strict=True) if not g}
    if not good.any():
        return None, failed, 0
    f16 = feats[good].astype(np.float16)
    if not np.isfinite(f16).all():  # float16 overflow (|x| > 65504): a broken model, not a broken file
        raise RuntimeError("frame features overflow float16; the checkpoint produces values above 65504")
    shard = Shard([k for k, g in zip(keys, good, strict=True) if g], f16, vbar[good].astype(np.float32), masks[good])
    if stages is not None:
        stages.host_s += time.perf_counter() - t1
        if not sub.events:  # on the CPU nothing was left to wait for
            stages.host_s += t1 - t0
    return shard, failed, int(masks[good].sum())


@torch.no_grad()
def encode_batch(model: Any, device: torch.device, precision: str, batch: dict[str, Any]) -> tuple[Shard | None, dict[str, str], int]:
    """Encode one collate_clips batch -> (shard of good clips or None, {key: reason} failures, frames used).

    The padded rows are whatever `model.encode_video` returns: zero for models trained here, the encoder's
    features (and v̄ the mean over all rows) for a checkpoint with `cfg.reference_padding`; both are stored as is.
    """
    return finish_batch(submit_batch(model, device, precision, batch))


class _CacheWriter:
    """One background thread that runs ``record`` (the work-cache write, an atomic npz with fsyncs, and the
    counters) for each finished batch in order, so that the encode loop does not wait for the disk. At most
    ``depth`` batches wait; an error in the thread is raised in the loop at the next :meth:`put` or at
    :meth:`close`."""

    def __init__(self, record: Callable[..., None], stages: EncodeStages, depth: int = 2) -> None:
        self._record, self._stages = record, stages
        self._q: queue.Queue[tuple[Any, ...] | None] = queue.Queue(maxsize=depth)
        self._err: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="gare-cache-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            if self._err is not None:  # drain after a failure; the loop raises it
                continue
            t0 = time.perf_counter()
            try:
                self._record(*item)
            except BaseException as e:  # noqa: BLE001 - handed to the loop's thread
                self._err = e
            self._stages.write_s += time.perf_counter() - t0

    def put(self, *item: Any) -> None:
        if self._err is not None:
            raise self._err
        self._q.put(item)

    def close(self, *, raise_error: bool = True) -> None:
        """Write what is queued (finished batches are worth keeping for a resumed run), then stop the thread."""
        self._q.put(None)
        self._thread.join()
        if raise_error and self._err is not None:
            raise self._err


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
        "status": "ok", **(c.fields or {}),
    }


class Encoder:
    """Runs the jobs through the local or Dask engine; every finished batch goes to the work cache."""

    def __init__(self, *, cache: WorkCache, report: RunReport, opts: BuildOptions, progress: bool) -> None:
        self.cache, self.report, self.opts = cache, report, opts
        self.failed: dict[str, str] = {}
        self.progress = progress
        self._pbar = None
        self._t0 = 0.0
        self.stages: EncodeStages | None = None  # the local engine's time accounting, after run()

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
                self._run_local(jobs, model=model, device=device, precision=precision)
        finally:
            self.report.encode_s = round(time.time() - self._t0, 3)
            self._pbar.close()
            self._pbar = None
        el = max(self.report.encode_s, 1e-9)
        self.report.videos_per_s = round(self.report.encoded / el, 3)
        self.report.frames_per_s = round(self.report.frames_encoded / el, 3)

    @torch.no_grad()
    def _run_local(self, jobs: list[Job], *, model: Any, device: Any, precision: str) -> None:
        """Decode in worker processes, encode in this one, write the work cache in a thread; batch n is on the device
        while batch n + 1 is fetched and batch n - 1 is written. The batches, their order and their arithmetic are
        those of a plain loop (the output is the same bits); only the waiting overlaps. Times: :class:`EncodeStages`."""
        cfg = model.cfg
        stages = EncodeStages(workers=self.opts.workers, timed_on="cuda events" if device.type == "cuda" else "cpu")
        writer = _CacheWriter(self._record, stages)
        it = iter_decoded(
            jobs, max_frames=cfg.max_frames, framerate=cfg.video_framerate, image_size=cfg.image_size,
            batch_size=decode_batch_size(len(jobs), self.opts.batch_size, self.opts.workers),
            num_workers=self.opts.workers, timeout=self.opts.decode_timeout, as_uint8=True,
        )
        t_loop = time.perf_counter()
        pending: tuple[_Submitted | None, dict[str, str], int] | None = None  # (submitted, decode failures, clips)
        ok = False
        try:
            while True:
                t0 = time.perf_counter()
                batch = next(it, None)
                stages.wait_s += time.perf_counter() - t0
                if stages.first_batch_s is None:
                    stages.first_batch_s = time.perf_counter() - t_loop
                if batch is None:
                    break
                stages.batches += 1
                stages.videos += len(batch["keys"])
                if batch["mask"] is not None:
                    stages.frames += int(batch["mask"].sum())
                stages.decode_s += float(batch.get("decode_s", 0.0))
                stages.decode_cpu_s += float(batch.get("decode_cpu_s", 0.0))
                cur = (submit_batch(model, device, precision, batch, stages), {k: r for k, r in batch["failed"]},
                       len(batch["keys"]) + len(batch["failed"]))
                if pending is not None:
                    self._finish(pending, writer, stages)
                pending = cur
            if pending is not None:
                self._finish(pending, writer, stages)
            ok = True
        finally:
            it.close()  # stops the decode workers when the loop ends early
            writer.close(raise_error=ok)
            stages.loop_s = time.perf_counter() - t_loop
            self.stages = stages
            self.report.encode_stages = stages.to_dict()
        log.info("%s", stages.line())

    def _finish(self, pending: tuple[_Submitted | None, dict[str, str], int], writer: _CacheWriter,
                stages: EncodeStages) -> None:
        sub, failed, done = pending
        shard, bad, nf = finish_batch(sub, stages)
        writer.put(shard, {**failed, **bad}, nf, done)


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
