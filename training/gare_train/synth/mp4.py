"""Writing frames as a reproducible H.264 mp4 (PyAV, libx264 single-threaded, without mbtree)."""

from __future__ import annotations

import os
from fractions import Fraction
from pathlib import Path

import numpy as np


def write_video(
    path: str | os.PathLike[str],
    frames: np.ndarray,
    fps: float,
    *,
    crf: int = 18,
    preset: str = "veryfast",
    faststart: bool = True,
) -> Path:
    """Encode ``frames`` (T, H, W, 3) uint8 RGB as H.264 (yuv420p) mp4 with PyAV.

    H and W must be even (yuv420p). Encoding is single-threaded and without mbtree so that the same
    frames always give the same bytes. With
    ``faststart`` the ``moov`` atom is written before the media data.
    """
    import av

    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"frames must be uint8 (T, H, W, 3), got {frames.dtype} {frames.shape}")
    t, h, w, _ = frames.shape
    if t < 1:
        raise ValueError("need at least one frame")
    if h % 2 or w % 2:
        raise ValueError(f"H.264 yuv420p needs even dimensions, got {w}x{h}")
    if not (fps > 0):
        raise ValueError(f"fps must be > 0, got {fps}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rate = Fraction(fps).limit_denominator(1001)
    options = {"movflags": "+faststart"} if faststart else {}
    with av.open(str(path), mode="w", format="mp4", options=options) as container:
        stream = container.add_stream("libx264", rate=rate)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        stream.codec_context.thread_count = 1
        stream.options = {
            "crf": str(int(crf)),
            "preset": preset,
            "threads": "1",
            "g": str(max(1, int(round(float(rate) * 2)))),
            # x264's macroblock-tree rate control made the output of identical input depend on what
            # was encoded before in the same process (seen with libx264 in PyAV 18); without it the
            # encoder is reproducible.
            "x264-params": "mbtree=0",
        }
        for i, arr in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(arr), format="rgb24")
            frame.pts = i
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path
