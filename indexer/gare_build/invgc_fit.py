"""InvGC for the index (SPEC §6, ``gare-index build --invgc``): the LocalAdj correction, the choice of r, the vectors.

``G' = ½[norm(G − r_g S^g Ĝ) + norm(G − r_q S^q Q̂)]`` with Ĝ, Q̂ the checkpoint's training video and query
queues (:func:`invgc_refs`). The corrected vectors only feed stage 1 (``ann_units.npy``, over which ``ann.faiss``
is built); ``units``/``norms`` keep v̄ for psi. LocalAdj centres the kept edge weights on their mean over the
whole gallery; that mean is computed once, when the index is built (:func:`invgc_means`; then
:func:`invgc_apply` equals :func:`gare.invgc.invgc` of the gallery), and recorded in the manifest, so that the
correction of an item depends on nothing but the item: ``add`` corrects new videos with the recorded r_g, r_q
and means, and ``remove`` only drops rows (:func:`gare_build.pipeline.finish.invgc_vectors`, the finish stage's step).

r_g and r_q are chosen on a validation split (:func:`select_invgc`: the dual-tower t2v R@1 of a grid, on a
caption manifest, a `gare-train synth` folder or the checkpoint's own training data, :func:`load_validation`).
Which runs apply InvGC is decided by :func:`gare_build.pipeline.plan.postprocess_setup`. See docs/postprocessing.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from gare.annotations import carve_validation, load_dataset, load_manifest
from gare.encoded_set import encode_set
from gare.invgc import DEFAULT_GRID, n_neighbours, select_r
from gare.retrieval_metrics import ranks_t2v
from gare_build.checkpoint_data import resolve_data_root

__all__ = ["InvGCUnavailable", "unit_tensor", "invgc_refs", "invgc_means", "invgc_apply", "load_validation", "t2v_r1",
           "select_invgc"]


class InvGCUnavailable(ValueError):
    """InvGC cannot run for this checkpoint or data: no training queues, no usable validation set."""


# ------------------------------------------------------------------------------------------ the correction
def unit_tensor(x: Any) -> torch.Tensor:
    """Rows of ``x`` (an array or a tensor) as unit float32 tensor rows."""
    t = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(np.asarray(x, dtype=np.float32)))
    return F.normalize(t.float(), dim=-1)


def invgc_refs(ckpt: Any) -> tuple[Any, Any]:
    """(Ĝ, Q̂): the checkpoint's training video and query queues as unit float32 tensors."""
    qv, qt = ckpt.queues.get("video"), ckpt.queues.get("text")
    missing = [name for name, q in (("video", qv), ("text", qt)) if q is None or q.numel() == 0]
    if missing:
        raise InvGCUnavailable(
            f"{ckpt.path}: InvGC needs the checkpoint's training queues (queues 'video' and 'text'); "
            f"missing: {missing} (checkpoints imported from the authors' code have none)"
        )
    return unit_tensor(qv.reshape(qv.shape[0], -1)), unit_tensor(qt.reshape(qt.shape[0], -1))


def _topk_rows(G: torch.Tensor, ref: torch.Tensor, kk: int, chunk: int) -> Iterator[tuple[int, Any]]:
    for i in range(0, G.shape[0], chunk):
        yield i, (G[i:i + chunk] @ ref.T).topk(kk, dim=1)


def invgc_means(gallery: Any, train_videos: Any, train_queries: Any, k_percent: float = 1.0,
                chunk: int = 4096) -> tuple[float, float]:
    """LocalAdj's centring constants: the mean of the kept (top k%) edge weights of the gallery against Ĝ and Q̂."""
    G = unit_tensor(gallery)
    out = []
    for ref in (train_videos, train_queries):
        ref = unit_tensor(ref)
        kk = n_neighbours(ref.shape[0], k_percent)
        total, count = 0.0, 0
        for _, top in _topk_rows(G, ref, kk, chunk):
            total += float(top.values.sum())
            count += top.values.numel()
        out.append(total / max(count, 1))
    return out[0], out[1]


def invgc_apply(gallery: Any, train_videos: Any, train_queries: Any, r_g: float, r_q: float, mean_g: float,
                mean_q: float, k_percent: float = 1.0, chunk: int = 4096) -> np.ndarray:
    """InvGC w/ LocalAdj with given centring constants: (n, d) unit float32. Row i depends only on row i.

    With the means from :func:`invgc_means` of the same gallery this is :func:`gare.invgc.invgc`."""
    G = unit_tensor(gallery)
    out = torch.empty_like(G)
    if G.shape[0] == 0:
        return out.numpy()
    Gh, Qh = unit_tensor(train_videos), unit_tensor(train_queries)
    kg, kq = n_neighbours(Gh.shape[0], k_percent), n_neighbours(Qh.shape[0], k_percent)
    with torch.no_grad():
        for i in range(0, G.shape[0], chunk):
            g = G[i:i + chunk]
            halves = []
            for ref, kk, r, mean in ((Gh, kg, r_g, mean_g), (Qh, kq, r_q, mean_q)):
                top = (g @ ref.T).topk(kk, dim=1)
                adj = torch.einsum("ck,ckd->cd", top.values - mean, ref[top.indices])
                halves.append(F.normalize(g - r * adj, dim=-1))
            out[i:i + chunk] = F.normalize(0.5 * (halves[0] + halves[1]), dim=-1)
    return np.ascontiguousarray(out.numpy(), dtype=np.float32)


# ------------------------------------------------------------------------------------------ choosing r
def load_validation(source: Any, ckpt: Any) -> tuple[Any, str]:
    """The validation captions and videos for the InvGC search, and a description for the manifest.

    `source`: a caption manifest (.csv / .jsonl: used whole), a `gare-train synth` folder or a data spec dict
    (the validation split is carved from its training split exactly as `gare-train fit` did: the checkpoint's
    val_fraction and seed), or None (the checkpoint's own training data, when its files are still there)."""
    ta = dict(getattr(ckpt, "train_args", None) or {})
    frac = float(ta.get("val_fraction") or 0.1)
    seed = int(ta.get("seed", 42))
    if source is None:
        spec = ta.get("data")
        if not spec:
            raise InvGCUnavailable("InvGC: no validation data; pass --invgc-val (a caption manifest or a synth folder) or "
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
        raise InvGCUnavailable(f"InvGC: cannot read the validation data {spec}: {e}") from e
    if not 0 < frac < 1:
        frac = 0.1
    _, val = carve_validation(full, frac, seed)
    return val, f"{spec.get('kind')} {spec.get('root') or spec.get('anno_dir') or spec.get('train')}: validation split " \
                f"carved from the training split (fraction {frac:g}, seed {seed})"


def t2v_r1(text_units: Any, gallery_units: Any, caption_clip: np.ndarray) -> float:
    """Dual-tower text-to-video R@1 (percent) of unit texts against unit gallery rows."""
    S = unit_tensor(text_units) @ unit_tensor(gallery_units).T
    return float(100.0 * np.mean(ranks_t2v(S, caption_clip) == 1))


def select_invgc(model: Any, ckpt: Any, source: Any, *, k_percent: float = 1.0, grid: Iterable[float] | None = None,
                 precision: str = "fp32", batch_size: int = 16, num_workers: int = 2,
                 refs: tuple[Any, Any] | None = None) -> dict[str, Any]:
    """Encode the validation set with `model` and grid-search (r_g, r_q) for the best dual-tower t2v R@1."""
    Gh, Qh = refs if refs is not None else invgc_refs(ckpt)
    rs, desc = load_validation(source, ckpt)
    enc = encode_set(model, rs, batch_size=batch_size, num_workers=num_workers, precision=precision)
    if enc.vbar.shape[0] < 2 or enc.t.shape[0] == 0:
        raise InvGCUnavailable(f"InvGC: the validation set ({desc}) has {enc.vbar.shape[0]} decodable videos; need >= 2")
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
