"""Choosing InvGC's r on a validation split (``gare-index build --invgc``; SPEC §6, docs/postprocessing.md).

CLI-side: this is the one indexer module that reads datasets and encodes them with the training evaluator
(the heavy ``gare_train.data`` / ``gare_train.evaluate``), so that :mod:`gare_build.postprocess` (the InvGC algebra)
and the index format stay light. Only ``gare_build.build``'s InvGC step, run from ``gare-index``, calls it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from gare_build.postprocess import invgc_refs, unit_tensor


def resolve_data_root(spec: Mapping[str, Any], ckpt_path: str | os.PathLike | None) -> dict[str, Any]:
    """A training data spec with relative paths resolved against the cwd, then the checkpoint's parents."""
    spec = dict(spec)
    keys = [k for k in ("root", "anno_dir", "videos_dir", "data_json", "train", "test") if spec.get(k)]
    bases = [Path.cwd()]
    if ckpt_path:
        bases += list(Path(ckpt_path).absolute().parents)[:4]
    for k in keys:
        p = Path(spec[k]).expanduser()
        if p.is_absolute():
            continue
        for b in bases:
            if (b / p).exists():
                spec[k] = str((b / p).absolute())
                break
    return spec


def load_validation(source: Any, ckpt: Any) -> tuple[Any, str]:
    """The validation captions and videos for the InvGC search, and a description for the manifest.

    `source`: a caption manifest (.csv / .jsonl: used whole), a `gare-train synth` folder or a data spec dict
    (the validation split is carved from its training split exactly as `gare-train fit` did: the checkpoint's
    val_fraction and seed), or None (the checkpoint's own training data, when its files are still there)."""
    from gare.annotations import carve_validation, load_dataset, load_manifest

    ta = dict(getattr(ckpt, "train_args", None) or {})
    frac = float(ta.get("val_fraction") or 0.1)
    seed = int(ta.get("seed", 42))
    if source is None:
        spec = ta.get("data")
        if not spec:
            raise ValueError("InvGC: no validation data; pass --invgc-val (a caption manifest or a synth folder) or "
                             "--invgc-r-g/--invgc-r-q")
        spec = resolve_data_root(spec, getattr(ckpt, "path", None))
    elif isinstance(source, Mapping):
        spec = dict(source)
    else:
        p = Path(source).expanduser().absolute()
        if p.is_file():
            rs = load_manifest(p, name="invgc-val")
            return rs, f"manifest {p}"
        if p.is_dir() and (p / "train.csv").is_file() and (p / "MSRVTT_data.json").is_file():
            spec = {"kind": "synth", "root": str(p)}
        else:
            raise ValueError(f"--invgc-val {source}: not a caption manifest (.csv/.jsonl) or a `gare-train synth` folder")
    try:
        full = load_dataset(spec, "train")
    except (OSError, KeyError) as e:
        raise ValueError(f"InvGC: cannot read the validation data {spec}: {e}") from e
    if not 0 < frac < 1:
        frac = 0.1
    _, val = carve_validation(full, frac, seed)
    return val, f"{spec.get('kind')} {spec.get('root') or spec.get('anno_dir') or spec.get('train')}: validation split " \
                f"carved from the training split (fraction {frac:g}, seed {seed})"


def t2v_r1(text_units: Any, gallery_units: Any, caption_clip: np.ndarray) -> float:
    """Dual-tower text-to-video R@1 (percent) of unit texts against unit gallery rows."""
    from gare.metrics import ranks_t2v

    S = unit_tensor(text_units) @ unit_tensor(gallery_units).T
    return float(100.0 * np.mean(ranks_t2v(S, caption_clip) == 1))


def select_invgc(model: Any, ckpt: Any, source: Any, *, k_percent: float = 1.0, grid: Iterable[float] | None = None,
                 precision: str = "fp32", batch_size: int = 16, num_workers: int = 2,
                 refs: tuple[Any, Any] | None = None) -> dict[str, Any]:
    """Encode the validation set with `model` and grid-search (r_g, r_q) for the best dual-tower t2v R@1."""
    from gare.encoded_set import encode_set
    from gare.invgc import DEFAULT_GRID, select_r

    Gh, Qh = refs if refs is not None else invgc_refs(ckpt)
    rs, desc = load_validation(source, ckpt)
    enc = encode_set(model, rs, batch_size=batch_size, num_workers=num_workers, precision=precision)
    if enc.vbar.shape[0] < 2 or enc.t.shape[0] == 0:
        raise ValueError(f"InvGC: the validation set ({desc}) has {enc.vbar.shape[0]} decodable videos; need >= 2")
    tn = unit_tensor(enc.t)
    cc = enc.caption_clip

    def evaluate(corrected) -> float:
        return t2v_r1(tn, corrected, cc)

    sel = select_r(enc.vbar, Gh, Qh, evaluate, grid=tuple(grid) if grid is not None else DEFAULT_GRID,
                   k_percent=k_percent)
    sel.update(method="grid", metric="validation t2v R@1 (dual-tower)", validation=desc,
               n_val_videos=int(enc.vbar.shape[0]), n_val_captions=int(enc.t.shape[0]),
               skipped_val_videos=len(enc.failed))
    return sel


__all__ = ["resolve_data_root", "load_validation", "t2v_r1", "select_invgc"]
