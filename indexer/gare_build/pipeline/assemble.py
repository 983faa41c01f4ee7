"""Stage 3 of build/add (and of remove), assembly: gather every entry's features, from the previous version or
the work/ cache, into the new version's arrays (frames and K/V staged as .npy files on disk)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gare_build.resumable_work import WorkCache, units_norms
from gare_index.frame_quant import DEFAULT_FRAME_DTYPE, FRAME_SCALES_ARRAY, QuantFrames, dequantize, quantize
from gare_index.npy_staging import alloc_npy
from gare_index.store import ExistingFile, IndexVersion


@dataclass
class Entry:
    meta: dict[str, Any]
    src: tuple  # ("prev", row) | ("shard", path, row)




def _put(frames: np.ndarray, scales: np.ndarray | None, dst: np.ndarray, fr: Any) -> None:
    """Float frames (m, f, d) into rows `dst` of the staged frames, quantised per frame when they are int8."""
    if scales is not None:
        frames[dst], scales[dst] = quantize(fr)
    else:
        frames[dst] = fr


def assemble(entries: list[Entry], f: int, d: int, prev: IndexVersion | None, cache: WorkCache | None,
              staging: Path, kv_fn: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]] | None,
              chunk: int = 8192, frames_dtype: str | None = None) -> dict[str, Any]:
    """Gather every entry's features into new arrays (frames and K/V staged as .npy files on disk).

    `frames_dtype`: "float16", or "int8" (per-frame scales, gare_index.frame_quant: rows of an int8 `prev` are
    copied as stored, the others quantised); None: prev's (DEFAULT_FRAME_DTYPE without one, as bench/results/frames_int8.md chose)."""
    staging.mkdir(parents=True, exist_ok=True)
    n = len(entries)
    ids = np.array([e.meta["id"] for e in entries], dtype=np.int64)
    int8 = (frames_dtype or (prev.frame_dtype if prev is not None else DEFAULT_FRAME_DTYPE)) == "int8"
    frames = alloc_npy(staging / "frames.npy", np.int8 if int8 else np.float16, (n, f, d))
    scales = alloc_npy(staging / f"{FRAME_SCALES_ARRAY}.npy", np.float32, (n, f)) if int8 else None
    units = np.zeros((n, d), dtype=np.float32)
    norms = np.zeros(n, dtype=np.float32)
    masks = np.zeros((n, f), dtype=np.uint8)
    want_kv = kv_fn is not None
    keys = values = None
    if want_kv:
        keys = alloc_npy(staging / "keys.npy", np.float16, (n, f, d))
        values = alloc_npy(staging / "values.npy", np.float16, (n, f, d))
    kv_done = np.zeros(n, dtype=bool)

    prev_dst = np.array([i for i, e in enumerate(entries) if e.src[0] == "prev"], dtype=np.int64)
    if prev_dst.size:
        assert prev is not None
        prev_src = np.array([entries[i].src[1] for i in prev_dst], dtype=np.int64)
        for s in range(0, prev_dst.size, chunk):
            dst, src = prev_dst[s : s + chunk], prev_src[s : s + chunk]
            order = np.argsort(src, kind="stable")  # sorted reads from the memmaps
            dst, src = dst[order], src[order]
            if int8 and prev.frame_scales is not None:  # int8 rows as stored (their psi constants stay valid)
                frames[dst], scales[dst] = prev.frames.q[src], prev.frame_scales[src]
            else:
                _put(frames, scales, dst, prev.frames[src])
            units[dst] = prev.units[src]
            norms[dst] = prev.norms[src]
            masks[dst] = prev.masks[src]
            if want_kv and prev.kv is not None:
                keys[dst] = prev.keys[src]
                values[dst] = prev.values[src]
                kv_done[dst] = True
    by_shard: dict[Path, list[tuple[int, int]]] = defaultdict(list)
    for i, e in enumerate(entries):
        if e.src[0] == "shard":
            by_shard[e.src[1]].append((i, e.src[2]))
    for path, pairs in by_shard.items():
        assert cache is not None
        sh = cache.load(path)
        dst = np.array([p[0] for p in pairs], dtype=np.int64)
        src = np.array([p[1] for p in pairs], dtype=np.int64)
        u, nn = units_norms(sh.vbar[src])
        _put(frames, scales, dst, sh.frames[src])
        units[dst] = u
        norms[dst] = nn
        masks[dst] = sh.masks[src]
    if want_kv:
        todo = np.flatnonzero(~kv_done)
        for s in range(0, todo.size, 1024):
            rows = todo[s : s + 1024]
            k, v = kv_fn(dequantize(frames[rows], scales[rows]) if int8 else np.asarray(frames[rows]))
            keys[rows] = k
            values[rows] = v
    for arr in (frames, scales, keys, values):
        if isinstance(arr, np.memmap):
            arr.flush()
    out: dict[str, Any] = {
        "ids": ids, "norms": norms, "units": units, "frames": ExistingFile(staging / "frames.npy"),
        "masks": masks,
    }
    del frames, scales
    if int8:
        out["frames"] = QuantFrames.from_files(out["frames"], ExistingFile(staging / f"{FRAME_SCALES_ARRAY}.npy"))
    if want_kv:
        del keys, values
        out["keys"] = ExistingFile(staging / "keys.npy")
        out["values"] = ExistingFile(staging / "values.npy")
    return out
