"""Reading one video for GARE: probing, frame sampling, decoding and CLIP preprocessing.

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
Many clips at once, in worker processes that one bad file cannot hang or stop, are
:mod:`gare.video_loader`'s job.

``decord``, ``av`` and ``torchvision`` are imported lazily, so importing this module is cheap.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import re
from collections.abc import Callable
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
    from torchvision.transforms import Compose, Normalize, ToTensor

    return Compose([clip_geometry(image_size), ToTensor(), Normalize(OPENAI_MEAN, OPENAI_STD)])


@functools.lru_cache(maxsize=8)
def clip_geometry(image_size: int) -> Any:
    """The geometric half of :func:`clip_transform` (PIL image -> resized, centre-cropped RGB PIL image): what a
    decode worker does when it hands on uint8 frames (``load_frames(..., as_uint8=True)``)."""
    from torchvision.transforms import CenterCrop, Compose, InterpolationMode, Resize

    return Compose([Resize(image_size, interpolation=InterpolationMode.BICUBIC), CenterCrop(image_size), _to_rgb])


def normalize_frames(frames: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """uint8 frames (..., f, 3, S, S) from ``load_frames(..., as_uint8=True)`` -> the float32 frames
    ``load_frames`` returns, bit for bit, on whatever device ``frames`` is on; the padded rows (``mask`` 0, shape
    (..., f)) are zero as there.

    Why: a float32 frame is 4x the bytes of its uint8 pixels; the build's decode workers send uint8 through the
    worker pipes and the normalising runs where the encoder runs (the GPU, when there is one). On the CPU it runs
    ToTensor + Normalize's own ops on the batch; on other devices it is a gather from a table of those ops' CPU
    results for the 256 values of each channel, because the same arithmetic on the GPU would differ in the last bit
    (CUDA divides by a scalar as a multiply by its reciprocal; the CPU divides). The two paths agree for every
    value (tested).
    """
    if frames.dtype != torch.uint8:
        raise ValueError(f"normalize_frames takes uint8 frames, got {frames.dtype}")
    if frames.device.type == "cpu":
        # on the CPU, ToTensor + Normalize's own ops in their order are those very results, and three elementwise
        # passes cost far less than the gather (bench/results/decode_pipeline.md times this function)
        mean, std = _normalise_consts()
        x = frames.to(torch.float32).div_(255).sub_(mean).div_(std)  # (..., f, 3, S, S)
    else:
        x = _normalise_by_table(frames)
    keep = mask.to(device=frames.device, dtype=torch.bool)[..., None, None, None]
    return x.where(keep, torch.zeros((), dtype=x.dtype, device=x.device))


def _normalise_by_table(frames: torch.Tensor) -> torch.Tensor:
    """uint8 (..., 3, S, S) -> float32 by a gather from :func:`_normalise_table` (exact on any device)."""
    table = _normalise_table(str(frames.device))  # (3 * 256,)
    offsets = torch.arange(0, 3 * 256, 256, dtype=torch.int32, device=frames.device).view(3, 1, 1)
    return table[frames.to(torch.int32) + offsets]


@functools.lru_cache(maxsize=1)
def _normalise_consts() -> tuple[torch.Tensor, torch.Tensor]:
    """Normalize's mean and std as it builds them: float32, (3, 1, 1)."""
    return (torch.tensor(OPENAI_MEAN, dtype=torch.float32).view(3, 1, 1),
            torch.tensor(OPENAI_STD, dtype=torch.float32).view(3, 1, 1))


@functools.lru_cache(maxsize=8)
def _normalise_table(device: str) -> torch.Tensor:
    """(3 * 256,) float32 on ``device``: entry 256 c + v is what ToTensor + Normalize make of value v in channel c,
    computed by those very ops on the CPU (a (3, 256, 1) image of every value)."""
    from torchvision.transforms import Normalize, ToTensor

    values = np.repeat(np.arange(256, dtype=np.uint8).reshape(256, 1, 1), 3, axis=2)  # (H=256, W=1, C=3)
    return Normalize(OPENAI_MEAN, OPENAI_STD)(ToTensor()(values)).reshape(-1).to(device)


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
    as_uint8: bool = False,
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

    images = [Image.fromarray(arr) for arr in raw]
    if augment is not None:
        images = augment(images)
    if as_uint8:
        geo = clip_geometry(int(image_size))
        frames = torch.zeros((max_frames, 3, image_size, image_size), dtype=torch.uint8)
        for i, img in enumerate(images):
            frames[i] = torch.from_numpy(np.array(geo(img))).permute(2, 0, 1)  # (S, S, 3) -> (3, S, S)
    else:
        tf = clip_transform(int(image_size))
        frames = torch.zeros((max_frames, 3, image_size, image_size), dtype=torch.float32)
        for i, img in enumerate(images):
            frames[i] = tf(img)
    mask = torch.zeros(max_frames, dtype=torch.int64)
    mask[: len(positions)] = 1
    return frames, mask


def is_video_file(path: str | os.PathLike[str]) -> bool:
    """True if ``path`` has one of :data:`VIDEO_EXTENSIONS` (case-insensitive)."""
    return Path(path).suffix.lower() in VIDEO_EXTENSIONS
