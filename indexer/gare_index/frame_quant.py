"""int8 frame storage: per-frame symmetric quantisation of frames.npy and the dequantising view readers use.

An index built with ``--frames-dtype int8`` stores ``frames.npy`` (n, f, d) int8 and ``frame_scales.npy`` (n, f)
float32 (manifest ``frame_dtype: "int8"``): frame g of video j is ``frame_scales[j, g] * frames[j, g]``, with
``scale = max_k |x_k| / 127`` and ``q = rint(x / scale)``, so every element is within scale / 2 of the
encoder's value (a zero frame, e.g. a padded one, has scale 0). 1 byte per value + 4 per frame instead of 2
per value: 6,192 bytes per video at f = 12, d = 512 against 12,288.

:class:`QuantFrames` is what :attr:`IndexVersion.frames` is for such an index (and what the builder passes
between its steps): indexing it gives float32 frames, so every reader that slices ``frames[rows]`` (psi's
constants, search by example, verify, the biases, the sharded paths) reads int8 indexes unchanged; the CPU
rerank kernel reads ``.q`` and ``.scales`` directly (its ``fscale`` argument). The psi constants of an int8
index are folded from these dequantised frames, so its rerank is exactly psi over the stored frames.

This module depends on numpy and :mod:`gare_index.npy_staging` only (below both the store and psi_consts).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from gare_index.npy_staging import ExistingFile, alloc_npy

FRAME_DTYPES = ("float16", "int8")
DEFAULT_FRAME_DTYPE = "float16"
FRAME_SCALES_ARRAY = "frame_scales"  # the array's name in a version (frame_scales.npy, (n, f) float32)
_BLOCK = 4096  # videos per quantisation step: 4096 x 12 x 512 x 4 B = 100 MB of float32 at a time


def check_frame_dtype(name: str) -> str:
    """`name` when it is a storage dtype of frames ("float16", "int8"; "fp16" accepted), else ValueError."""
    name = {"fp16": "float16", "half": "float16"}.get(str(name), str(name))
    if name not in FRAME_DTYPES:
        raise ValueError(f"--frames-dtype must be one of {', '.join(FRAME_DTYPES)}, got {name!r}")
    return name


def quantize(frames: Any) -> tuple[np.ndarray, np.ndarray]:
    """(…, f, d) float frames -> (int8 (…, f, d), float32 scales (…, f)), symmetric per frame."""
    x = np.asarray(frames, dtype=np.float32)
    scales = (np.abs(x).max(axis=-1) / 127.0).astype(np.float32)
    inv = np.divide(1.0, scales, out=np.zeros_like(scales), where=scales > 0)
    q = np.clip(np.rint(x * inv[..., None]), -127, 127).astype(np.int8)
    return q, scales


def dequantize(q: Any, scales: Any) -> np.ndarray:
    """int8 (…, f, d) and scales (…, f) -> float32 frames."""
    return np.asarray(q, dtype=np.float32) * np.asarray(scales, dtype=np.float32)[..., None]


class QuantFrames:
    """int8 frames with per-frame scales, read as float32: ``qf[rows]`` is ``dequantize(q[rows], scales[rows])``.

    `q` (n, f, d) int8 and `scales` (n, f) float32 arrays or memmaps; `files`: the (frames, scales) .npy files
    they were read from, when the writer may link them instead of copying."""

    def __init__(self, q: Any, scales: Any, files: tuple[ExistingFile, ExistingFile] | None = None) -> None:
        if q.dtype != np.int8 or q.ndim != 3:
            raise ValueError(f"int8 frames must be (n, f, d) int8, got {q.dtype} {q.shape}")
        if tuple(scales.shape) != tuple(q.shape[:2]) or scales.dtype != np.float32:
            raise ValueError(f"frame scales must be float32 {tuple(q.shape[:2])}, got {scales.dtype} {tuple(scales.shape)}")
        self.q, self.scales, self.files = q, scales, files

    @classmethod
    def from_files(cls, frames: ExistingFile, scales: ExistingFile) -> QuantFrames:
        load = lambda e: np.load(e.path, mmap_mode="r", allow_pickle=False)  # noqa: E731
        return cls(load(frames), load(scales), (frames, scales))

    shape = property(lambda self: tuple(self.q.shape))
    ndim = 3
    dtype = np.dtype(np.float32)  # what indexing returns
    frame_dtype = "int8"

    @property
    def nbytes(self) -> int:
        """Stored bytes (int8 values + float32 scales)."""
        return int(self.q.nbytes + self.scales.nbytes)

    def __len__(self) -> int:
        return int(self.q.shape[0])

    def __getitem__(self, sel: Any) -> np.ndarray:
        if isinstance(sel, tuple):  # frames[rows, g] etc.: dequantise the rows, then index the rest
            return self[sel[0]][(slice(None), *sel[1:])] if not np.isscalar(sel[0]) else self[sel[0]][sel[1:]]
        return dequantize(self.q[sel], self.scales[sel])

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self[:]
        return out if dtype is None else out.astype(dtype)


def frame_dtype_of(frames: Any) -> str:
    """"int8" for QuantFrames or an int8 array/file, else "float16"."""
    if isinstance(frames, QuantFrames):
        return "int8"
    if isinstance(frames, ExistingFile):
        return "int8" if np.load(frames.path, mmap_mode="r", allow_pickle=False).dtype == np.int8 else "float16"
    return "int8" if np.asarray(frames[:0]).dtype == np.int8 else "float16"


def frames_view(arrays: dict[str, Any]) -> Any:
    """arrays["frames"] readable as float frames: a QuantFrames when they are int8 (with arrays["frame_scales"]),
    a memmap for a staged file, else the array as given."""
    fr = arrays["frames"]
    if isinstance(fr, QuantFrames):
        return fr
    sc = arrays.get(FRAME_SCALES_ARRAY)
    load = lambda v: np.load(v.path, mmap_mode="r", allow_pickle=False) if isinstance(v, ExistingFile) else v  # noqa: E731
    arr = load(fr)
    if arr.dtype == np.int8:
        if sc is None:
            raise ValueError(f"int8 frames need {FRAME_SCALES_ARRAY}.npy (the per-frame scales)")
        files = (fr, sc) if isinstance(fr, ExistingFile) and isinstance(sc, ExistingFile) else None
        return QuantFrames(arr, load(sc), files)
    return arr


def quantize_to(frames: Any, staging: Path | None) -> QuantFrames:
    """Quantise (n, f, d) float frames (array, memmap or QuantFrames) block by block: into .npy files in
    `staging` (a 1M-video index never holds its frames in memory), or in memory when `staging` is None."""
    if isinstance(frames, QuantFrames):
        return frames
    n, f, d = frames.shape
    if staging is None:
        q, s = quantize(frames)
        return QuantFrames(q, s)
    staging.mkdir(parents=True, exist_ok=True)
    qp, sp = staging / "frames.int8.npy", staging / f"{FRAME_SCALES_ARRAY}.npy"
    q, s = alloc_npy(qp, np.int8, (n, f, d)), alloc_npy(sp, np.float32, (n, f))
    for s0 in range(0, n, _BLOCK):
        q[s0 : s0 + _BLOCK], s[s0 : s0 + _BLOCK] = quantize(frames[s0 : s0 + _BLOCK])
    for a in (q, s):
        if isinstance(a, np.memmap):
            a.flush()
    del q, s
    return QuantFrames.from_files(ExistingFile(qp), ExistingFile(sp))
