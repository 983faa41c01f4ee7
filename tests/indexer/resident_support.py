"""Shared helpers of the resident-index tests (holds no tests): a small gallery written with the real index writer
(ids that are not rows, exact ties, psi constants, the folded NCL stage 1), the numpy references, and arrays that
refuse to be read."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tests.indexer.test_index_store import SHA, extra, synth_arrays
from tests.psi_weights import randomize_psi

N, D, F = 240, 64, 6  # the tiny model's d and f
TIE_EVERY, TIE_AXES = 10, 3  # rows 0, 10, 20, ...: one-hot units on axis (row // 10) % 3 -> exact ties


def tiny_model(seed: int = 0):
    from gare.config import get_model_config
    from gare.model import GARE

    torch.manual_seed(seed)
    model = GARE.build(get_model_config("gare-test-tiny")).eval()
    randomize_psi(model.psi)
    return model


def tie_rows() -> np.ndarray:
    return np.arange(0, N, TIE_EVERY)


def write_gallery(root: Path, model, *, frame_dtype: str = "float16", seed: int = 3) -> Path:
    """A flat index of N videos (ids 10, 13, 16, ...: not rows) with psi constants and ann_ncl.faiss. Rows
    0, 10, 20, ... have one-hot units e_a (a = (row // 10) % 3) and the same bias per axis: a query near e_a ties
    them exactly (the dot products are exact in any summation order), across both halves of the gallery."""
    from gare_index import psi_consts
    from gare_index.store import write_version

    arrays, meta = synth_arrays(N, d=D, f=F, seed=seed)
    rows = tie_rows()
    axis = (rows // TIE_EVERY) % TIE_AXES
    units = arrays["units"].copy()
    units[rows] = 0.0
    units[rows, axis] = 1.0
    arrays["units"] = units
    arrays["biases"] = arrays["biases"] * 3.0
    arrays["biases"][rows] = 0.02 * axis.astype(np.float32)
    entry = psi_consts.attach(arrays, model, checkpoint_sha=SHA, device="cpu")
    more = {"frame_dtype": "int8"} if frame_dtype == "int8" else {}
    write_version(root, arrays, meta, {**extra("flat"), "psi_fold": entry, "ncl_stage1": {"c": 1.0}, **more})
    return root


def unit(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def queries(seed: int = 5, n: int = 9) -> np.ndarray:
    """n random unit queries, then three near e_0, e_1, e_2 (whose top results are exact ties)."""
    rng = np.random.default_rng(seed)
    near = np.eye(D, dtype=np.float32)[:TIE_AXES] * 4.0 + rng.standard_normal((TIE_AXES, D)).astype(np.float32) * 0.05
    return unit(np.concatenate([rng.standard_normal((n, D)).astype(np.float32), near]))


def brute_force(stage1: np.ndarray, biases: np.ndarray, ids: np.ndarray, q: np.ndarray, k: int, *,
                ncl: bool) -> tuple[np.ndarray, np.ndarray]:
    """numpy top-k: by cos (+ b with ncl) descending, then id ascending; (cosines, ids), padded with -inf / -1."""
    cos = q @ np.asarray(stage1, dtype=np.float32).T  # (a, n)
    key = cos + np.asarray(biases, dtype=np.float32) if ncl else cos
    out_s = np.full((q.shape[0], k), -np.inf, np.float32)
    out_i = np.full((q.shape[0], k), -1, np.int64)
    for r in range(q.shape[0]):
        order = np.lexsort((ids, -key[r]))[:k]
        out_s[r, : order.size], out_i[r, : order.size] = cos[r, order], ids[order]
    return out_s, out_i


def boundary_tie(stage1: np.ndarray, biases: np.ndarray, q: np.ndarray, k: int, *, ncl: bool) -> bool:
    """Whether some query's k-th and (k+1)-th keys are equal (the tie rule decides which ids are in)."""
    key = q @ np.asarray(stage1, dtype=np.float32).T + (np.asarray(biases) if ncl else 0.0)
    srt = -np.sort(-key, axis=1)
    return bool((srt[:, k - 1] == srt[:, k]).any())


class Unreadable:
    """Stands in for a host array after the resident copy: its shape and dtype read, any row read fails."""

    def __init__(self, like) -> None:
        self.shape, self.dtype, self.ndim = tuple(like.shape), like.dtype, len(like.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, sel):
        raise AssertionError(f"a host array of shape {self.shape} was read at {sel!r} after the resident copy")

    def __array__(self, dtype=None, copy=None):
        raise AssertionError(f"a host array of shape {self.shape} was converted after the resident copy")


def make_unreadable(version) -> None:
    """Every per-row array the rerank and stage 1 could read from the host (frames, their scales, the psi
    constants, masks, units, norms, stage-1 vectors) refuses to be read from now on."""
    from gare_index.frame_quant import QuantFrames

    for name in ("psi_consts", "masks", "units", "norms", "ann_units", "keys", "values"):
        arr = getattr(version, name)
        if arr is not None:
            setattr(version, name, Unreadable(arr))
    fr = version.frames
    version.frames = QuantFrames.__new__(QuantFrames) if isinstance(fr, QuantFrames) else Unreadable(fr)
    if isinstance(fr, QuantFrames):
        version.frames.q, version.frames.scales, version.frames.files = Unreadable(fr.q), Unreadable(fr.scales), None
