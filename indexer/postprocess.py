"""Index-side post-processing (SPEC §5-6): InvGC-corrected stage-1 vectors, NCL biases folded into stage 1,
and NCL biases from a bank of served queries. See docs/postprocessing.md.

* **InvGC with LocalAdj** (``gare-index build --invgc``). ``G' = ½[norm(G − r_g S^g Ĝ) + norm(G − r_q S^q Q̂)]``
  with Ĝ, Q̂ the checkpoint's training video and query queues. The corrected vectors only feed stage 1
  (``ann_units.npy``, over which ``ann.faiss`` is built); ``units``/``norms`` keep v̄ for psi. LocalAdj
  centres the kept edge weights on their mean over the whole gallery; that mean is computed once, when the
  index is built (then the result equals :func:`training.invgc.invgc` of the gallery), and recorded in the
  manifest, so that the correction of an item depends on nothing but the item: ``add`` corrects new videos
  with the recorded r_g, r_q and means, and ``remove`` only drops rows.
* **NCL biases inside stage 1** (``--ncl-stage1``): a second inner-product index ``ann_ncl.faiss`` over
  ``[v̂_j ; b_j / c]`` (v̂ = the stage-1 vectors), searched with ``[t̂ ; c]``, so its inner product is
  ``cos(t, v̂_j) + b_j`` exactly (:func:`training.sinkhorn.fold_biases`). :func:`ncl_ann_stage` is the
  stage-1 function a search uses in place of ``service.search.ann_stage``.
* **Biases from traffic** (``gare-index biases --from-traffic BANK.npy``): :func:`load_query_bank` validates
  a float32 (n, d) file of unit query embeddings (never unpickled), :func:`mix_queues` mixes it with the
  checkpoint's training queue.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

NCL_ANN_FILE = "ann_ncl.faiss"
DEFAULT_FOLD_C = 1.0
TRAFFIC_SEED = 0
MAX_BANK_ROWS = 10_000_000  # a bank bigger than this is refused (the service keeps a bounded queue)


# ------------------------------------------------------------------------------------------ InvGC
def _unit_t(x: Any):
    import torch
    import torch.nn.functional as F

    t = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(np.asarray(x, dtype=np.float32)))
    return F.normalize(t.float(), dim=-1)


def invgc_refs(ckpt: Any) -> tuple[Any, Any]:
    """(Ĝ, Q̂): the checkpoint's training video and query queues as unit float32 tensors."""
    qv, qt = ckpt.queues.get("video"), ckpt.queues.get("text")
    missing = [name for name, q in (("video", qv), ("text", qt)) if q is None or q.numel() == 0]
    if missing:
        raise ValueError(
            f"{ckpt.path}: InvGC needs the checkpoint's training queues (queues 'video' and 'text'); "
            f"missing: {missing} (checkpoints imported from the authors' code have none)"
        )
    return _unit_t(qv.reshape(qv.shape[0], -1)), _unit_t(qt.reshape(qt.shape[0], -1))


def _topk_rows(G, ref, kk: int, chunk: int):
    for i in range(0, G.shape[0], chunk):
        yield i, (G[i:i + chunk] @ ref.T).topk(kk, dim=1)


def invgc_means(gallery: Any, train_videos: Any, train_queries: Any, k_percent: float = 1.0,
                chunk: int = 4096) -> tuple[float, float]:
    """LocalAdj's centring constants: the mean of the kept (top k%) edge weights of the gallery against Ĝ and Q̂."""
    from training.invgc import n_neighbours

    G = _unit_t(gallery)
    out = []
    for ref in (train_videos, train_queries):
        ref = _unit_t(ref)
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

    With the means from :func:`invgc_means` of the same gallery this is :func:`training.invgc.invgc`."""
    import torch
    import torch.nn.functional as F

    from training.invgc import n_neighbours

    G = _unit_t(gallery)
    out = torch.empty_like(G)
    if G.shape[0] == 0:
        return out.numpy()
    Gh, Qh = _unit_t(train_videos), _unit_t(train_queries)
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
    from training.data import carve_validation, load_dataset, load_manifest

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
    from training.metrics import ranks_t2v

    S = _unit_t(text_units) @ _unit_t(gallery_units).T
    return float(100.0 * np.mean(ranks_t2v(S, caption_clip) == 1))


def select_invgc(model: Any, ckpt: Any, source: Any, *, k_percent: float = 1.0, grid: Iterable[float] | None = None,
                 precision: str = "fp32", batch_size: int = 16, num_workers: int = 2,
                 refs: tuple[Any, Any] | None = None) -> dict[str, Any]:
    """Encode the validation set with `model` and grid-search (r_g, r_q) for the best dual-tower t2v R@1."""
    from training.evaluate import encode_set
    from training.invgc import DEFAULT_GRID, select_r

    Gh, Qh = refs if refs is not None else invgc_refs(ckpt)
    rs, desc = load_validation(source, ckpt)
    enc = encode_set(model, rs, batch_size=batch_size, num_workers=num_workers, precision=precision)
    if enc.vbar.shape[0] < 2 or enc.t.shape[0] == 0:
        raise ValueError(f"InvGC: the validation set ({desc}) has {enc.vbar.shape[0]} decodable videos; need >= 2")
    tn = _unit_t(enc.t)
    cc = enc.caption_clip

    def evaluate(corrected) -> float:
        return t2v_r1(tn, corrected, cc)

    sel = select_r(enc.vbar, Gh, Qh, evaluate, grid=tuple(grid) if grid is not None else DEFAULT_GRID,
                   k_percent=k_percent)
    sel.update(method="grid", metric="validation t2v R@1 (dual-tower)", validation=desc,
               n_val_videos=int(enc.vbar.shape[0]), n_val_captions=int(enc.t.shape[0]),
               skipped_val_videos=len(enc.failed))
    return sel


# ------------------------------------------------------------------------------------------ folded NCL stage 1
class FoldedRows:
    """Row access to [v̂_j ; b_j / c] without materialising it (ivfpq re-scoring of the folded index)."""

    def __init__(self, stage1: np.ndarray, biases: np.ndarray, c: float = DEFAULT_FOLD_C) -> None:
        self.stage1, self.biases, self.c = stage1, np.asarray(biases, dtype=np.float32), float(c)
        self.shape = (int(stage1.shape[0]), int(stage1.shape[1]) + 1)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, rows: Any) -> np.ndarray:
        from training.sinkhorn import fold_biases

        return fold_biases(np.asarray(self.stage1[rows], dtype=np.float32), self.biases[rows], self.c)


def ncl_ann_params(main: Mapping[str, Any] | None, d: int, index_type: str | None = None) -> dict[str, Any]:
    """ANN params of the folded index: the main index's type and knobs (pq_m re-chosen when it does not divide d+1)."""
    from .ann import AnnParams, choose_index_type

    p = dict(main or {})
    if index_type is not None:
        p["index_type"] = index_type
    p.setdefault("index_type", "flat")
    if p["index_type"] == "ivfpq" and p.get("pq_m") and (d + 1) % int(p["pq_m"]):
        p["pq_m"] = None
    if p["index_type"] not in ("flat", "ivf", "hnsw", "ivfpq"):
        p["index_type"] = choose_index_type(0)
    return AnnParams.from_dict(p).to_dict()


def build_ncl_ann(stage1: np.ndarray, biases: np.ndarray, ids: np.ndarray, params: Mapping[str, Any],
                  c: float = DEFAULT_FOLD_C, chunk: int = 65536) -> Any:
    """The folded inner-product index over [v̂_j ; b_j / c] with the video ids (an AnnIndex)."""
    from training.sinkhorn import fold_biases

    from .ann import AnnIndex, AnnParams, build_index, default_nlist

    n, d = int(stage1.shape[0]), int(stage1.shape[1])
    p = AnnParams.from_dict(dict(params))
    if p.index_type in ("ivf", "ivfpq") and n == 0:
        p = AnnParams("flat")
    b = np.asarray(biases, dtype=np.float32)
    ids = np.asarray(ids, dtype=np.int64)

    def fold(rows: Any) -> np.ndarray:
        return fold_biases(np.asarray(stage1[rows], dtype=np.float32), b[rows], c)

    if n <= chunk:
        first = np.arange(n)
    elif p.index_type in ("ivf", "ivfpq"):
        # train the quantiser on a seeded sample (as build_index would), then add the rest in chunks
        nlist = int(p.nlist or default_nlist(n))
        p = AnnParams.from_dict({**p.to_dict(), "nlist": nlist})
        first = np.sort(np.random.default_rng(1234).choice(n, size=min(n, max(64 * nlist, 16_384)), replace=False))
    else:
        first = np.arange(chunk)
    folded = fold(first) if n else np.zeros((0, d + 1), np.float32)
    ann = AnnIndex(build_index(folded, ids[first], p, use_gpu=False), p)
    if first.size < n:
        rest = np.setdiff1d(np.arange(n), first)
        for s in range(0, rest.size, chunk):
            r = rest[s:s + chunk]
            ann.add(fold(r), ids[r])
    # ivfpq re-scores its shortlist exactly from the folded rows (computed on the fly, never stored)
    return AnnIndex(ann.cpu_index, p, FoldedRows(stage1, b, c), vector_ids=ids)


def ncl_ann_stage(version: Any, units: np.ndarray, candidates: int) -> tuple[np.ndarray, np.ndarray]:
    """Stage 1 with the NCL biases folded in: candidates are the top K by cos(t, v̂_j) + b_j.

    Drop-in for ``service.search.ann_stage``: (cosines (q, K), ids (q, K)), missing results id -1. The
    returned scores are the stage-1 cosines (the folded score minus b_j), so ``service.search.rank`` with
    ``ncl=True`` adds b_j exactly once, whether the list is then reranked with psi or not. Needs an index
    built with ``--ncl-stage1`` (``version.ann_ncl``)."""
    if units.shape[0] == 0:
        return np.zeros((0, candidates), np.float32), np.zeros((0, candidates), np.int64)
    scores, ids = version.search_ncl(np.ascontiguousarray(units, dtype=np.float32), int(candidates))
    scores = np.asarray(scores, dtype=np.float32).copy()
    ids = np.asarray(ids, dtype=np.int64)
    ok = ids >= 0
    if ok.any():
        scores[ok] -= np.asarray(version.biases, dtype=np.float32)[version.rows(ids[ok])]
    return scores, ids


# ------------------------------------------------------------------------------------------ traffic bank
def load_query_bank(path: str | os.PathLike, d: int, *, max_rows: int = MAX_BANK_ROWS) -> tuple[np.ndarray, dict[str, Any]]:
    """A validated bank of served query embeddings: float32 (n, d), finite, non-zero rows (re-normalised).

    Never unpickles (``allow_pickle=False``); any problem raises ValueError with the reason."""
    from .store import file_sha256

    p = Path(path).expanduser().absolute()
    if not p.is_file():
        raise ValueError(f"--from-traffic {path}: no such file")
    try:
        arr = np.load(p, mmap_mode="r", allow_pickle=False)
    except ValueError as e:  # object arrays (pickles) and bad headers
        raise ValueError(f"--from-traffic {p}: not a plain numeric .npy array ({e})") from None
    except (OSError, EOFError) as e:
        raise ValueError(f"--from-traffic {p}: unreadable .npy file ({e})") from None
    if not isinstance(arr, np.ndarray):
        raise ValueError(f"--from-traffic {p}: an .npy array is expected, not an .npz archive")
    if arr.dtype != np.float32:
        raise ValueError(f"--from-traffic {p}: dtype {arr.dtype}, expected float32 (unit query embeddings)")
    if arr.ndim != 2 or arr.shape[1] != d:
        raise ValueError(f"--from-traffic {p}: shape {arr.shape}, expected (n, {d}) for this index (d={d})")
    n = int(arr.shape[0])
    if n == 0:
        raise ValueError(f"--from-traffic {p}: the bank is empty")
    if n > max_rows:
        raise ValueError(f"--from-traffic {p}: {n} rows, more than the {max_rows} accepted")
    x = np.array(arr, dtype=np.float32)
    if not np.all(np.isfinite(x)):
        bad = int((~np.isfinite(x)).any(axis=1).sum())
        raise ValueError(f"--from-traffic {p}: {bad} rows hold NaN or infinite values")
    norms = np.linalg.norm(x, axis=1)
    if np.any(norms < 1e-6):
        raise ValueError(f"--from-traffic {p}: {int((norms < 1e-6).sum())} rows are zero vectors")
    far = int((np.abs(norms - 1.0) > 1e-2).sum())
    if far:
        log.warning("%s: %d of %d query embeddings are not unit length; they are normalised", p, far, n)
    info = {"file": str(p), "sha256": file_sha256(p), "rows": n, "non_unit_rows": far}
    return (x / norms[:, None]).astype(np.float32), info


def _subsample(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    if k >= n:
        return np.arange(n)
    return np.sort(rng.choice(n, size=k, replace=False))


def mix_queues(train: np.ndarray | None, bank: np.ndarray, weight: float, *, seed: int = TRAFFIC_SEED
               ) -> tuple[np.ndarray, dict[str, Any]]:
    """The mixed query queue: a fraction `weight` of traffic queries, the rest from the training queue.

    Size: the training queue's (Q), or the bank's when there is no training queue. When the bank holds fewer
    than weight * Q rows, all of it is used and the training part shrinks so the fraction stays `weight`.
    Rows are subsampled without replacement by a seeded generator (same inputs, same queue)."""
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"--traffic-weight must be in [0, 1], got {weight}")
    rng = np.random.default_rng(seed)
    n_b = int(bank.shape[0])
    q = 0 if train is None else int(train.shape[0])
    if q == 0:
        n_t, n_q = n_b, 0
    else:
        n_t = int(round(weight * q))
        n_q = q - n_t
        if n_t > n_b:
            n_t = n_b
            n_q = min(q, int(round(n_b * (1.0 - weight) / weight))) if weight > 0 else q
    parts = []
    if n_q:
        assert train is not None
        parts.append(np.asarray(train, dtype=np.float32)[_subsample(q, n_q, rng)])
    if n_t:
        parts.append(bank[_subsample(n_b, n_t, rng)])
    mixed = np.concatenate(parts) if parts else np.zeros((0, bank.shape[1]), np.float32)
    info = {"traffic_weight": float(weight), "traffic_queries": n_t, "train_queries": n_q,
            "weight_effective": round(n_t / max(1, n_t + n_q), 6), "seed": seed}
    if q == 0:
        info["note"] = "the checkpoint has no training query queue: traffic queries only"
    return mixed, info


# ------------------------------------------------------------------------------------------ helpers for tests/bench
def exact_ncl_topk(stage1: np.ndarray, biases: np.ndarray, ids: np.ndarray, queries: np.ndarray, k: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Brute-force reference: top k by cos + b (ties by id), (scores, ids)."""
    s = np.asarray(queries, np.float32) @ np.asarray(stage1, np.float32).T + np.asarray(biases, np.float32)[None, :]
    order = np.stack([np.lexsort((ids, -row))[:k] for row in s])
    return np.take_along_axis(s, order, 1), np.asarray(ids)[order]


def coverage(reference_top: np.ndarray, candidates: np.ndarray, ks: Sequence[int]) -> dict[int, float]:
    """Share of each query's reference ids (q, top) inside its first K candidates (q, >= max ks), averaged."""
    out = {}
    ref = np.asarray(reference_top)
    for k in ks:
        c = np.asarray(candidates)[:, :k]
        hits = [np.isin(r, cc[cc >= 0]).mean() for r, cc in zip(ref, c, strict=True)]
        out[int(k)] = float(np.mean(hits)) if hits else math.nan
    return out


__all__ = [
    "NCL_ANN_FILE", "DEFAULT_FOLD_C", "invgc_refs", "invgc_means", "invgc_apply", "load_validation", "select_invgc",
    "t2v_r1", "FoldedRows", "ncl_ann_params", "build_ncl_ann", "ncl_ann_stage", "load_query_bank", "mix_queues",
    "exact_ncl_topk", "coverage",
]

