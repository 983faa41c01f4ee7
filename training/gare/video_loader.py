"""Decoding many clips for GARE: the clip dataset, batch collation and a fault-tolerant worker-process decoder.

:class:`ClipDataset` decodes one ``(key, path, start, end)`` item with :func:`gare.video.load_frames` and never
raises; :func:`iter_decoded` decodes many clips in worker processes and never lets one bad file hang or stop the
loop: failures come back in the batch's ``failed`` list.
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import signal
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gare.video import VideoDecodeError, load_frames

log = logging.getLogger(__name__)




@dataclass
class DecodedClip:
    key: Any
    frames: torch.Tensor | None
    mask: torch.Tensor | None
    error: str | None


Item = tuple[Any, Any, float | None, float | None]


def _as_item(item: Sequence[Any]) -> Item:
    if len(item) == 2:
        return (item[0], item[1], None, None)
    if len(item) == 4:
        return (item[0], item[1], item[2], item[3])
    raise ValueError(f"clip items are (key, path, start, end) or (key, path); got {item!r}")


class ClipDataset(torch.utils.data.Dataset):
    """Clips to decode: ``items`` are ``(key, path, start, end)`` (``start``/``end`` seconds or None).

    Files are opened in ``__getitem__`` (so in the DataLoader worker). ``__getitem__`` never raises:
    a failure comes back as a :class:`DecodedClip` with ``error`` set.
    """

    def __init__(self, items: Iterable[Sequence[Any]], *, max_frames: int, framerate: float, image_size: int,
                 as_uint8: bool = False):
        self.items: list[Item] = [_as_item(it) for it in items]
        self.max_frames = int(max_frames)
        self.framerate = float(framerate)
        self.image_size = int(image_size)
        self.as_uint8 = bool(as_uint8)  # uint8 frames (load_frames' as_uint8), normalised by the consumer

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> DecodedClip:
        return self.decode(index)

    def decode(self, index: int, augment: Callable[[list[Any]], list[Any]] | None = None) -> DecodedClip:
        """Item `index`, its frames passed through `augment` (see `load_frames`) when given."""
        key, path, start, end = self.items[index]
        # One decode thread per worker process; the main process may use decord's own threading.
        threads = 1 if _IN_DECODE_WORKER or torch.utils.data.get_worker_info() is not None else 0
        try:
            frames, mask = load_frames(
                path,
                max_frames=self.max_frames,
                framerate=self.framerate,
                image_size=self.image_size,
                start=start,
                end=end,
                num_threads=threads,
                augment=augment,
                as_uint8=self.as_uint8,
            )
        except VideoDecodeError as e:
            return DecodedClip(key, None, None, e.reason)
        except Exception as e:  # decord's DECORDError is not a RuntimeError; catch all but BaseException
            return DecodedClip(key, None, None, f"{type(e).__name__}: {str(e).strip()[:300]}")
        return DecodedClip(key, frames, mask, None)


def collate_clips(batch: list[DecodedClip]) -> dict[str, Any]:
    """Stack the decoded clips of a batch; failed ones go to ``failed`` as ``(key, reason)``."""

    def good(c: DecodedClip) -> bool:
        return c.error is None and c.frames is not None and c.mask is not None

    ok = [c for c in batch if good(c)]
    failed = [(c.key, c.error or "unknown error") for c in batch if not good(c)]
    return {
        "keys": [c.key for c in ok],
        "frames": torch.stack([c.frames for c in ok]) if ok else None,
        "mask": torch.stack([c.mask for c in ok]) if ok else None,
        "failed": failed,
    }


def _merge_batches(batches: list[dict[str, Any]]) -> dict[str, Any]:
    frames = [b["frames"] for b in batches if b["frames"] is not None]
    masks = [b["mask"] for b in batches if b["mask"] is not None]
    return {
        "keys": [k for b in batches for k in b["keys"]],
        "frames": torch.cat(frames) if frames else None,
        "mask": torch.cat(masks) if masks else None,
        "failed": [f for b in batches for f in b["failed"]],
    }


class DecoderCrashed(RuntimeError):
    """A decoding worker process died (e.g. the decoder segfaulted on a corrupt file)."""


class DecoderTimeout(RuntimeError):
    """A decoding worker produced nothing for longer than the allowed time."""


# Set in a decode worker process of :func:`_loader_run` (one decoder thread per process).
_IN_DECODE_WORKER = False


def _decode_worker(ds: ClipDataset, tasks: Any, results: Any) -> None:
    """A decode worker process: decode and collate the batches it is given, in the order given, until None."""
    global _IN_DECODE_WORKER
    _IN_DECODE_WORKER = True
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it stops the workers
    torch.set_num_threads(1)
    while True:
        task = tasks.get()
        if task is None:
            return
        b, indices = task
        t0, c0 = time.perf_counter(), time.process_time()
        batch = collate_clips([ds[i] for i in indices])
        # this worker's own clocks for the batch (wall and CPU seconds): the consumer can tell decode-bound from
        # starved workers without timing anything itself
        batch["decode_s"], batch["decode_cpu_s"] = time.perf_counter() - t0, time.process_time() - c0
        results.put((b, batch))


def _stop(workers: list[Any], tasks: list[Any], *, clean: bool) -> None:
    """End the workers: a clean finish lets them exit on their own, anything else kills them; then reap."""
    if clean:
        for q in tasks:
            q.put(None)
        for w in workers:
            w.join(timeout=10.0)
    for w in workers:
        try:
            if w.is_alive():
                w.kill()
            w.join(timeout=1.0)
        except Exception:  # noqa: BLE001 - best effort
            pass
    for q in tasks:
        q.cancel_join_thread()  # never block this process's exit on a dead worker's queue
        q.close()


def _loader_run(
    items: list[Item], ds_kwargs: dict[str, Any], batch_size: int, num_workers: int, timeout: float
) -> Iterator[tuple[str, Any]]:
    """Decode ``items`` in batches in a pool of worker processes; yields ("batch", dict)... in order, then
    maybe ("error", exc).

    A plain ``multiprocessing`` pool (fork, like the DataLoader's workers on Linux) whose processes this
    function owns, so failures are handled here with public APIs only:

    * a worker that dies is noticed within a fraction of a second (its ``exitcode``) and reported as
      :class:`DecoderCrashed`, after the batches that came out before it in order;
    * when no batch arrives for ``timeout`` seconds the workers are killed and :class:`DecoderTimeout`
      is reported;
    * no signal handler is installed, so a crash cannot raise an error at an arbitrary point of the caller.

    Batch b goes to worker b % n, at most two batches per worker in flight (the DataLoader's prefetch).
    """
    ds = ClipDataset(items, **ds_kwargs)
    batches = [list(range(s, min(s + batch_size, len(items)))) for s in range(0, len(items), batch_size)]
    if not batches:
        return
    n = max(1, min(num_workers, len(batches)))
    ctx = multiprocessing.get_context("fork")
    tasks = [ctx.Queue() for _ in range(n)]
    results = ctx.Queue()
    workers = [
        ctx.Process(target=_decode_worker, args=(ds, tasks[w], results), name=f"gare-decode-{w}", daemon=True)
        for w in range(n)
    ]
    for w in workers:
        w.start()
    sent = 0

    def send_upto(limit: int) -> None:
        nonlocal sent
        while sent < min(limit, len(batches)):
            tasks[sent % n].put((sent, batches[sent]))
            sent += 1

    clean = False
    try:
        send_upto(2 * n)
        pending: dict[int, dict[str, Any]] = {}
        nxt = 0
        deadline = time.monotonic() + timeout
        while nxt < len(batches):
            if nxt in pending:
                batch = pending.pop(nxt)
                nxt += 1
                send_upto(nxt + 2 * n)
                yield "batch", batch
                deadline = time.monotonic() + timeout
                continue
            try:
                b, batch = results.get(timeout=0.1)
            except queue.Empty:
                pass
            else:
                pending[b] = batch
                deadline = time.monotonic() + timeout
                continue
            dead = [w for w in workers if w.exitcode not in (None, 0)]
            if dead:
                # Batches that made it out before the death are still good (results are yielded in order).
                while True:
                    try:
                        b, batch = results.get_nowait()
                    except queue.Empty:
                        break
                    pending[b] = batch
                while nxt in pending:
                    yield "batch", pending.pop(nxt)
                    nxt += 1
                if nxt >= len(batches):
                    clean = True
                    return
                code = dead[0].exitcode
                how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
                yield "error", DecoderCrashed(f"decoder worker process died ({how})")
                return
            if time.monotonic() > deadline:
                yield "error", DecoderTimeout(f"no decoded batch for {timeout:g}s")
                return
        clean = True
    finally:
        _stop(workers, tasks, clean=clean)
        results.cancel_join_thread()
        results.close()


# Decode batches per worker the library is split into at least (when it is small enough to need splitting): with
# one batch per worker every worker finishes at about the same time and the encoder starts only then (the H200 run
# at 5215253, bench/results/history/gpu_bench_h200_5215253.md: 600 videos in 16 batches of 38); with several, the encoder works on the
# first batches while the workers decode the next ones.
DECODE_WAVES = 4


def decode_batch_size(n_jobs: int, batch_size: int, workers: int) -> int:
    """Videos per decoded batch: ``batch_size``, or fewer when the library is too small to give every decode worker
    ``DECODE_WAVES`` batches (iter_decoded hands whole batches to workers, two in flight each: 300 videos in
    batches of 64 kept 5 of 16 workers busy on a GPU machine), so that all ``workers`` decode at once and the
    encoder overlaps them; ``workers`` 0 decodes in this process (one stream: the batch stays as configured)."""
    if n_jobs < 1 or batch_size < 1 or workers < 0:
        raise ValueError(f"n_jobs and batch_size must be >= 1 and workers >= 0, got {n_jobs}, {batch_size}, {workers}")
    if workers == 0:
        return batch_size
    return max(1, min(batch_size, n_jobs // (DECODE_WAVES * workers)))


def iter_decoded(
    items: Iterable[Sequence[Any]],
    *,
    max_frames: int,
    framerate: float,
    image_size: int,
    batch_size: int = 8,
    num_workers: int = 2,
    timeout: float = 300.0,
    as_uint8: bool = False,
) -> Iterator[dict[str, Any]]:
    """Decode ``(key, path, start, end)`` items in batches, in order, in worker processes (:func:`_loader_run`).

    Yields :func:`collate_clips` dicts. Undecodable files are reported in ``failed`` with a reason. A batch decoded
    in a worker process also carries ``decode_s`` / ``decode_cpu_s``: that worker's wall and CPU seconds for it.
    If a worker process dies (e.g. the decoder crashes) or no batch arrives for ``timeout`` seconds,
    the batch in flight is retried one clip at a time in fresh workers, so that only the culprit is
    reported as failed, and decoding resumes after it. ``num_workers=0`` decodes in this process
    (no crash or hang protection). ``as_uint8``: the batches' frames are uint8 pixels, a quarter of the bytes
    through the worker pipes; :func:`gare.video.normalize_frames` makes them the float32 frames exactly.
    """
    all_items = [_as_item(it) for it in items]
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    ds_kwargs = {"max_frames": max_frames, "framerate": framerate, "image_size": image_size, "as_uint8": as_uint8}
    if num_workers <= 0:
        loader = torch.utils.data.DataLoader(
            ClipDataset(all_items, **ds_kwargs),
            batch_size=batch_size,
            shuffle=False,
            collate_fn=collate_clips,
        )
        yield from loader
        return

    pos = 0
    while pos < len(all_items):
        error: BaseException | None = None
        for kind, payload in _loader_run(all_items[pos:], ds_kwargs, batch_size, num_workers, timeout):
            if kind == "batch":
                pos += len(payload["keys"]) + len(payload["failed"])
                yield payload
            else:
                error = payload
        if error is None or pos >= len(all_items):
            break
        suspects = all_items[pos : pos + batch_size]
        log.warning(
            "video decoding failed (%s); retrying %d clip(s) one by one", _short(error), len(suspects)
        )
        yield _merge_batches([_decode_isolated(item, ds_kwargs, timeout) for item in suspects])
        pos += len(suspects)


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _decode_isolated(item: Item, ds_kwargs: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Decode one clip in its own worker process; a crash or hang becomes a failure entry."""
    for kind, payload in _loader_run([item], ds_kwargs, 1, 1, timeout):
        if kind == "batch":
            return payload
        if isinstance(payload, DecoderTimeout):
            reason = f"decoder timed out after {timeout:g}s"
        elif isinstance(payload, DecoderCrashed):
            reason = f"decoder crashed: {payload}"
        else:
            reason = f"decoder failed: {_short(payload)}"
        return {"keys": [], "frames": None, "mask": None, "failed": [(item[0], reason)]}
    return {"keys": [], "frames": None, "mask": None, "failed": [(item[0], "decoder returned nothing")]}
