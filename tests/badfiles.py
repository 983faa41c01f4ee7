"""Genuinely broken "videos" for the tests (empty, truncated, random bytes, no moov box, wrong container,
text): test fixtures, so they live under tests/ rather than in the training package."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from gare_train.synth import write_video


def mp4_atoms(data: bytes) -> list[tuple[bytes, int, int]]:
    """Top-level ISO-BMFF boxes as ``(type, offset, size)``."""
    out: list[tuple[bytes, int, int]] = []
    i = 0
    while i + 8 <= len(data):
        size, typ = struct.unpack(">I4s", data[i : i + 8])
        header = 8
        if size == 1:
            if i + 16 > len(data):
                break
            size = struct.unpack(">Q", data[i + 8 : i + 16])[0]
            header = 16
        elif size == 0:
            size = len(data) - i
        if size < header:
            break
        out.append((typ, i, size))
        i += size
    return out


def write_bad_videos(directory: str | os.PathLike[str]) -> dict[str, Path]:
    """Write genuinely broken "videos" for tests; returns ``{kind: path}``.

    Kinds: ``empty`` (0 bytes), ``truncated`` (a good faststart mp4 cut in half: header intact, media
    data missing), ``random`` (random bytes), ``no_moov`` (a good mp4 without its ``moov`` box),
    ``wrong_container`` (a PNG named .mp4) and ``text`` (a text file named .mp4).
    """
    from PIL import Image

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1234)
    good = d / "_good_source.mp4"
    frames = rng.integers(0, 256, size=(32, 64, 64, 3), dtype=np.uint8)
    write_video(good, frames, 8.0, faststart=True)
    data = good.read_bytes()
    good.unlink()

    out: dict[str, Path] = {}
    out["empty"] = d / "empty.mp4"
    out["empty"].write_bytes(b"")
    out["truncated"] = d / "truncated.mp4"
    out["truncated"].write_bytes(data[: len(data) // 2])
    out["random"] = d / "random.mp4"
    out["random"].write_bytes(rng.bytes(8192))
    atoms = mp4_atoms(data)
    if not any(t == b"moov" for t, _, _ in atoms):  # pragma: no cover - PyAV always writes one
        raise RuntimeError("no moov box in the encoded mp4")
    out["no_moov"] = d / "no_moov.mp4"
    out["no_moov"].write_bytes(b"".join(data[o : o + s] for t, o, s in atoms if t != b"moov"))
    out["wrong_container"] = d / "wrong_container.mp4"
    Image.fromarray(frames[0]).save(out["wrong_container"], format="PNG")
    out["text"] = d / "text.mp4"
    out["text"].write_text("this is not a video\n" * 20, encoding="utf-8")
    return out
