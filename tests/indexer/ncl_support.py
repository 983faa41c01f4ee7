"""Validation captions built so that an index's NCL biases lose or win for a known reason (issue 28; holds no tests).

For each caption of a pool, the exhaustive psi scores of the indexed videos are computed here with `model.score`
(independent of the fold the builder uses); a caption whose top-1 video under psi differs from its top-1 under
psi + b is a *flip*. Validation manifests then name, for every flip caption, either its psi top-1 as the true video
(psi right, psi + b wrong: the biases lose R@1) or its psi + b top-1 (the biases win R@1 and keep R@5)."""

from __future__ import annotations

import csv
import itertools
from pathlib import Path

import numpy as np
import torch

from gare.checkpoint import load_model
from gare_index.store import open_index

COLOURS = ("red", "green", "blue", "yellow", "cyan", "magenta", "white", "orange")
SHAPES = ("circle", "square", "triangle", "diamond", "star", "plus sign")
MOTIONS = ("moves left", "moves right", "rises", "falls", "does not move", "spins")


def caption_pool() -> list[str]:
    return [f"a {c} {s} {m}" for c, s, m in itertools.product(COLOURS, SHAPES, MOTIONS)]


def served_scores(ckpt: Path, index: Path, captions: list[str]) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(psi scores (a, n) with model.score, the version's biases (n,), the indexed videos' paths in row order)."""
    model, _ = load_model(ckpt, "cpu")
    v = open_index(index)
    frames = torch.from_numpy(np.asarray(v.frames, dtype=np.float32))
    mask = torch.from_numpy(np.asarray(v.masks).astype(bool))
    vbar = torch.from_numpy(np.asarray(v.units, dtype=np.float32) * np.asarray(v.norms, dtype=np.float32)[:, None])
    with torch.inference_mode():
        t = model.encode_text(model.tokenize(captions)).float()
        S = model.score(t, frames, mask, vbar=vbar).float().numpy()
    paths = [m["path"] for m in v.metadata(np.asarray(v.ids))]
    return S, np.asarray(v.biases, dtype=np.float32), paths


def flip_manifests(ckpt: Path, index: Path, out: Path, min_gap: float = 1e-4) -> tuple[Path, Path, int]:
    """(lose.csv, win.csv, number of flip captions) under ``out``; asserts there is at least one flip."""
    pool = caption_pool()
    S, b, paths = served_scores(ckpt, index, pool)
    top_psi, top_b = S.argmax(1), (S + b[None, :]).argmax(1)
    srt, srt_b = np.sort(S, 1), np.sort(S + b[None, :], 1)
    # clear flips only: both top-1s win by more than float noise
    flips = [i for i in range(len(pool)) if top_psi[i] != top_b[i] and srt[i, -1] - srt[i, -2] > min_gap
             and srt_b[i, -1] - srt_b[i, -2] > min_gap]
    assert flips, "no caption of the pool changes its top-1 with the biases"
    out.mkdir(parents=True, exist_ok=True)
    files = []
    for name, top in (("lose", top_psi), ("win", top_b)):
        p = out / f"{name}.csv"
        with open(p, "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["video", "caption"])
            for i in flips:
                w.writerow([paths[int(top[i])], pool[i]])
        files.append(p)
    return files[0], files[1], len(flips)
