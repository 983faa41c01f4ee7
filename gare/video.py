"""Video decoding for GARE: frame sampling, CLIP preprocessing and a fault-tolerant batch decoder.

Sampling and preprocessing follow the authors' decord path (``_get_rawvideo_dec`` in the reference
dataloader) so that embeddings computed here match the paper's evaluation protocol:

* ``fps = get_avg_fps()``; the window is ``[int(start * fps), min(end * fps, len - 1)]`` (whole video
  when no window is given);
* every ``round(fps / framerate)``-th frame of the window is kept; when more than ``max_frames``
  remain, ``max_frames`` of them are picked with ``np.linspace(0, n - 1, max_frames, dtype=int)``;
* each frame goes through the CLIP test transform (bicubic resize of the shorter side, centre crop,
  RGB, ``ToTensor``, OpenAI mean/std normalisation), and the clip is zero-padded to ``max_frames``
  with a 0/1 mask.

Two deliberate, documented differences from the reference: ``start``/``end`` may be float seconds (the
reference truncates them to whole seconds), and ``framerate`` may be fractional (the reference uses
``int(framerate)``). For integer seconds and integer framerates the sampled positions are identical.

Everything that can go wrong with a file is reported as :class:`VideoDecodeError` with a short reason.
:func:`iter_decoded` decodes many clips in worker processes and never lets one bad file hang
or stop the loop: failures come back in the batch's ``failed`` list.

``decord``, ``av`` and ``torchvision`` are imported lazily, so importing this module is cheap.
"""

from __future__ import annotations

import functools
import logging
import math
import multiprocessing
import os
import queue
import re
import signal
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

OPENAI_MEAN: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)

VIDEO_EXTENSIONS: frozenset[str] = frozenset(
    {".mp4", ".mkv", ".webm", ".mov", ".avi", ".m4v", ".mpg", ".mpeg", ".wmv", ".flv", ".ts"}
)

# Refuse frames larger than this many pixels (checked from the container header, before decoding).
MAX_FRAME_PIXELS: int = 8192 * 8192

# FFmpeg demuxers that read still images; a picture renamed to .mp4 is not a video.
_IMAGE_DEMUXERS = ("image2", "png_pipe", "jpeg_pipe", "bmp_pipe", "webp_pipe", "tiff_pipe", "gif")

# FFmpeg error codes (AVERROR tags) that decord reports as bare numbers.
_FFMPEG_ERRORS = {
    1094995529: "invalid data: truncated or corrupt file",
    541478725: "unexpected end of file",
}

_DECORD_LOG_PREFIX = re.compile(r"^\[[0-9:]+\]\s+\S+:\d+:\s*(ERROR\s*|Error:\s*)?")


class VideoDecodeError(Exception):
    """A video could not be decoded. ``path`` is the file, ``reason`` a short human-readable cause."""

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        self.path = str(path)
        self.reason = str(reason)
        super().__init__(f"{self.reason}: {self.path}")

    def __reduce__(self) -> tuple[Any, ...]:  # keep (path, reason) across process boundaries
        return (type(self), (self.path, self.reason))


@dataclass
class VideoInfo:
    num_frames: int
    fps: float
    duration: float  # seconds, num_frames / fps
    width: int
    height: int


# --------------------------------------------------------------------------------------------------
# sampling (pure)
# --------------------------------------------------------------------------------------------------


def _normalise_window(start: float | None, end: float | None) -> tuple[float | None, float | None]:
    """Clamp negative times to 0, swap a reversed window, widen an empty one to one second."""
    if start is not None:
        start = max(float(start), 0.0)
    if end is not None:
        end = max(float(end), 0.0)
    if start is not None and end is not None:
        if start > end:
            start, end = end, start
        elif start == end:
            end = start + 1.0
    return start, end


def sample_positions(
    num_frames: int,
    fps: float,
    framerate: float,
    max_frames: int,
    start: float | None = None,
    end: float | None = None,
) -> list[int]:
    """Frame indices the reference decoder would read (see module docstring). May be empty."""
    if max_frames < 1:
        raise ValueError(f"max_frames must be >= 1, got {max_frames}")
    if not (framerate > 0):
        raise ValueError(f"framerate must be > 0, got {framerate}")
    if not (fps > 0) or not math.isfinite(fps):
        raise ValueError(f"fps must be a positive finite number, got {fps}")
    if num_frames <= 0:
        return []
    start, end = _normalise_window(start, end)
    f_start = 0 if start is None else int(start * fps)
    f_end = int(min(math.inf if end is None else end * fps, num_frames - 1))
    if f_end < f_start:
        return []
    stride = max(1, int(round(float(fps) / float(framerate))))
    positions = list(range(f_start, f_end + 1, stride))
    if len(positions) > max_frames:
        picks = np.linspace(0, len(positions) - 1, num=max_frames, dtype=int)
        positions = [positions[i] for i in picks]
    return positions


# --------------------------------------------------------------------------------------------------
# opening / probing
# --------------------------------------------------------------------------------------------------


def _clean_decord_message(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    msg = lines[0] if lines else type(exc).__name__
    # Drop decord's "[hh:mm:ss] /src/file.cc:123: ERROR" log prefix and its "Stack trace" tail.
    msg = _DECORD_LOG_PREFIX.sub("", msg)
    for code, meaning in _FFMPEG_ERRORS.items():
        if re.search(rf"(?<!\d)-?{code}(?!\d)", msg):
            msg = f"{msg} ({meaning})"
            break
    return msg[:300] or type(exc).__name__


def _header_probe(path: str) -> tuple[int, int, str | None, str | None]:
    """(width, height, demuxer name, error) from the container header via PyAV; decodes nothing.

    Width/height are 0 when unknown. This is advisory: decord has the final word on decodability.
    """
    try:
        import av
    except ImportError:  # pragma: no cover - av is a hard dependency, but keep decoding without it
        return 0, 0, None, None
    try:
        with av.open(path) as container:
            fmt = getattr(container.format, "name", None)
            streams = container.streams.video
            if not streams:
                return 0, 0, fmt, "no video stream"
            cc = streams[0].codec_context
            return int(cc.width or 0), int(cc.height or 0), fmt, None
    except Exception as e:  # noqa: BLE001 - any PyAV failure just means "unknown"
        msg = str(e)
        msg = re.sub(r"^\[Errno -?\d+\]\s*", "", msg)
        msg = msg.split(": '")[0]  # PyAV appends ": '<path>'"
        return 0, 0, None, msg[:200] or type(e).__name__


def _open_reader(path: str | os.PathLike[str], num_threads: int = 0) -> tuple[Any, int, int]:
    """Open ``path`` with decord after sanity checks. Returns (reader, header width, header height)."""
    p = str(path)
    if not os.path.exists(p):
        raise VideoDecodeError(p, "file not found")
    if not os.path.isfile(p):
        raise VideoDecodeError(p, "not a regular file")
    try:
        size = os.path.getsize(p)
    except OSError as e:
        raise VideoDecodeError(p, f"cannot stat: {e.strerror or e}") from e
    if size == 0:
        raise VideoDecodeError(p, "empty file")
    if not os.access(p, os.R_OK):
        raise VideoDecodeError(p, "permission denied")

    width, height, fmt, av_error = _header_probe(p)
    if fmt is not None and any(fmt == d or fmt.startswith(d) for d in _IMAGE_DEMUXERS):
        raise VideoDecodeError(p, f"not a video container (detected {fmt})")
    if width > 0 and height > 0 and width * height > MAX_FRAME_PIXELS:
        raise VideoDecodeError(p, f"frame too large: {width}x{height} exceeds {MAX_FRAME_PIXELS} pixels")

    import decord

    try:
        reader = decord.VideoReader(p, ctx=decord.cpu(0), num_threads=num_threads)
    except Exception as e:  # RuntimeError, decord DECORDError (not a RuntimeError), AssertionError
        msg = _clean_decord_message(e)
        if av_error and msg.startswith("Error reading"):  # decord's generic message; PyAV says why
            msg = av_error
        raise VideoDecodeError(p, f"cannot open: {msg}") from e

    try:
        n = len(reader)
        fps = float(reader.get_avg_fps())
    except Exception as e:
        raise VideoDecodeError(p, f"cannot read metadata: {_clean_decord_message(e)}") from e
    if n <= 0:
        raise VideoDecodeError(p, "no frames")
    if not math.isfinite(fps) or fps <= 0:
        raise VideoDecodeError(p, f"invalid fps ({fps})")
    return reader, width, height


def probe_video(path: str | os.PathLike[str]) -> VideoInfo:
    """Frame count, average fps, duration and size of a video. Raises :class:`VideoDecodeError`."""
    reader, width, height = _open_reader(path, num_threads=1)
    n = len(reader)
    fps = float(reader.get_avg_fps())
    if width <= 0 or height <= 0:  # header did not say; decode the first frame to find out
        try:
            h, w = reader[0].shape[:2]
        except Exception as e:
            raise VideoDecodeError(path, f"decode failed: {_clean_decord_message(e)}") from e
        width, height = int(w), int(h)
    return VideoInfo(num_frames=n, fps=fps, duration=n / fps, width=width, height=height)


# --------------------------------------------------------------------------------------------------
# decoding + CLIP preprocessing
# --------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def clip_transform(image_size: int) -> Any:
    """The CLIP evaluation transform used by the reference (PIL image -> normalised CHW tensor)."""
    from torchvision.transforms import CenterCrop, Compose, InterpolationMode, Normalize, Resize, ToTensor

    return Compose(
        [
            Resize(image_size, interpolation=InterpolationMode.BICUBIC),
            CenterCrop(image_size),
            _to_rgb,
            ToTensor(),
            Normalize(OPENAI_MEAN, OPENAI_STD),
        ]
    )


def _to_rgb(image: Any) -> Any:
    return image.convert("RGB")


def load_frames(
    path: str | os.PathLike[str],
    *,
    max_frames: int,
    framerate: float,
    image_size: int,
    start: float | None = None,
    end: float | None = None,
    num_threads: int = 0,
    augment: Callable[[list[Any]], list[Any]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode and preprocess one clip.

    ``augment`` (training only) maps the clip's decoded PIL frames to augmented ones before the CLIP
    transform, as the authors apply RandAugment; evaluation and indexing never pass it.

    Returns ``frames`` float32 ``(max_frames, 3, image_size, image_size)`` (zero rows after the real
    frames) and ``mask`` int64 ``(max_frames,)`` with 1 for real frames. ``start``/``end`` are seconds.
    Raises :class:`VideoDecodeError` for anything wrong with the file or the window.
    """
    from PIL import Image

    if image_size < 1:
        raise ValueError(f"image_size must be >= 1, got {image_size}")
    reader, _, _ = _open_reader(path, num_threads=num_threads)
    n = len(reader)
    fps = float(reader.get_avg_fps())
    positions = sample_positions(n, fps, framerate, max_frames, start, end)
    if not positions:
        raise VideoDecodeError(
            path, f"no frames in range (start={start}, end={end}, {n} frames at {fps:g} fps)"
        )
    try:
        raw = reader.get_batch(positions).asnumpy()
    except Exception as e:
        raise VideoDecodeError(path, f"decode failed: {_clean_decord_message(e)}") from e
    finally:
        del reader
    if raw.ndim != 4 or raw.shape[0] != len(positions) or raw.shape[-1] != 3:
        raise VideoDecodeError(path, f"decoder returned an unexpected array of shape {tuple(raw.shape)}")

    tf = clip_transform(int(image_size))
    frames = torch.zeros((max_frames, 3, image_size, image_size), dtype=torch.float32)
    images = [Image.fromarray(arr) for arr in raw]
    if augment is not None:
        images = augment(images)
    for i, img in enumerate(images):
        frames[i] = tf(img)
    mask = torch.zeros(max_frames, dtype=torch.int64)
    mask[: len(positions)] = 1
    return frames, mask


# --------------------------------------------------------------------------------------------------
# batch decoding
# --------------------------------------------------------------------------------------------------


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

    def __init__(self, items: Iterable[Sequence[Any]], *, max_frames: int, framerate: float, image_size: int):
        self.items: list[Item] = [_as_item(it) for it in items]
        self.max_frames = int(max_frames)
        self.framerate = float(framerate)
        self.image_size = int(image_size)

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
        results.put((b, collate_clips([ds[i] for i in indices])))


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


def iter_decoded(
    items: Iterable[Sequence[Any]],
    *,
    max_frames: int,
    framerate: float,
    image_size: int,
    batch_size: int = 8,
    num_workers: int = 2,
    timeout: float = 300.0,
) -> Iterator[dict[str, Any]]:
    """Decode ``(key, path, start, end)`` items in batches, in order, in worker processes (:func:`_loader_run`).

    Yields :func:`collate_clips` dicts. Undecodable files are reported in ``failed`` with a reason.
    If a worker process dies (e.g. the decoder crashes) or no batch arrives for ``timeout`` seconds,
    the batch in flight is retried one clip at a time in fresh workers, so that only the culprit is
    reported as failed, and decoding resumes after it. ``num_workers=0`` decodes in this process
    (no crash or hang protection).
    """
    all_items = [_as_item(it) for it in items]
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    ds_kwargs = {"max_frames": max_frames, "framerate": framerate, "image_size": image_size}
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


def is_video_file(path: str | os.PathLike[str]) -> bool:
    """True if ``path`` has one of :data:`VIDEO_EXTENSIONS` (case-insensitive)."""
    return Path(path).suffix.lower() in VIDEO_EXTENSIONS
