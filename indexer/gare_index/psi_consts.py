"""psi's per-video constants in the index and the folded psi weights: compute, carry, check, serve.

`gare.psi_fold` folds psi exactly into per-video constants and per-query vectors, so the rerank costs
~3f + 1 dot products per pair instead of ~4 d x d products. The index stores one float32 row per video,
``psi_consts.npy`` (n, 10f + 5f² + 2) (842 floats = 3,368 bytes at f = 12), folded from the stored float16
frames, the masks and the served v̄ = norm * unit (SPEC §4), and the manifest entry ``psi_fold``::

    {"fingerprint": sha256 of psi's weights (gare.psi_fold.psi_fingerprint),
     "checkpoint_sha256": the checkpoint they come from, "floats_per_video": 842, "bytes_per_video": 3368,
     "dtype": "float32", "vbar": "norms*units", "file": "psi_consts.npy"}

Constants are only valid for the psi weights they were folded with: :func:`fold_status` compares the
fingerprint (and the checkpoint hash) with the served model's, and the search reads them only when they
match; otherwise :func:`served` folds them in memory once per version (one WARNING naming `gare-index
upgrade`, which adds them to an index written before this change). :func:`fold_of` is the one cache of the
folded psi weights (keyed by psi's identity and parameter versions).

This module depends on the core only (not on :mod:`gare_index.store`, which imports it for the array name and
the checks of :func:`problems`): it reads a version through the Protocol :class:`gare_index.version_protocol.PsiVersion`.

float32, not float16: float16 constants move the scores by ~3e-5, over the 1e-5 the implementations agree to.
"""

from __future__ import annotations

import logging
import threading
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from gare.checkpoint import file_sha256, load_model
from gare.model_protocols import PsiModel
from gare.psi import Psi
from gare.psi_fold_videos import VideoConstants, fold_videos, packed_width
from gare.psi_fold_weights import PsiFold, fold_weights
from gare_index.frame_quant import frames_view
from gare_index.npy_staging import ExistingFile, alloc_npy
from gare_index.version_protocol import PsiVersion

log = logging.getLogger(__name__)

MANIFEST_KEY = "psi_fold"
PSI_CONSTS_ARRAY = "psi_consts"  # the array's name in a version (psi_consts.npy)
_BLOCK = 4096  # videos per fold_videos call: ~4096·12·512·4 B = 100 MB of float32 frames at a time


# ------------------------------------------------------------------------------------------ weights
class _FoldEntry:
    """One cached fold: psi (weakly), its parameter slots and their (version, data pointer) at fold time."""

    __slots__ = ("fold", "psi", "slots", "stamp")

    def __init__(self, psi: Psi) -> None:
        self.psi = weakref.ref(psi)
        # (the owning module's _parameters dict, name, tensor): a slot rebound to another tensor is seen by an
        # identity test, an in-place change by the tensor's _version, a move (.to) by its data pointer
        self.slots = [(mod._parameters, name, p) for mod in psi.modules() for name, p in mod._parameters.items()
                      if p is not None]
        self.stamp = [(p._version, p.data_ptr()) for _, _, p in self.slots]
        self.fold = fold_weights(psi)

    def valid_for(self, psi: Psi) -> bool:
        """Whether psi is the module folded and none of its parameters changed (the served rerank asks once per
        request: the stamps of psi's tensors, a few times cheaper than a walk of psi.parameters())."""
        if self.psi() is not psi:
            return False
        for (params, name, p), (ver, ptr) in zip(self.slots, self.stamp, strict=True):
            if params.get(name) is not p or p._version != ver or p.data_ptr() != ptr:
                return False
        return True


_FOLDS: dict[int, _FoldEntry] = {}  # id(psi) -> its fold; at most 8 (one per checkpoint loaded)
FOLD_COUNT = [0]  # how many times fold_of walked and folded psi (tests: an unchanged model does not re-fold)


def fold_of(model: PsiModel) -> PsiFold:
    """fold_weights(model.psi), cached while psi's parameters are unchanged (once per checkpoint): a parameter
    changed in place, rebound or moved gives a new fold."""
    psi = model.psi
    hit = _FOLDS.get(id(psi))
    if hit is None or not hit.valid_for(psi):
        hit = _FOLDS[id(psi)] = _FoldEntry(psi)
        FOLD_COUNT[0] += 1
        if len(_FOLDS) > 8:
            _FOLDS.pop(next(iter(_FOLDS)))
    return hit.fold


def reference_padding(model: PsiModel) -> bool:
    """Whether psi attends to the padded rows too (checkpoints imported with the authors' padding)."""
    return bool(getattr(model.cfg, "reference_padding", False))


def _default_device(device: torch.device | str | None = None) -> torch.device:
    if device is not None:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# ------------------------------------------------------------------------------------------ compute
def _vbar(units: Any, norms: Any, s0: int, s1: int) -> np.ndarray:
    return np.asarray(units[s0:s1], dtype=np.float32) * np.asarray(norms[s0:s1], dtype=np.float32)[:, None]


def compute_rows(fold: PsiFold, frames: Any, masks: Any, units: Any, norms: Any, out: np.ndarray, rows: np.ndarray | None = None,
                 *, device: torch.device | str | None = None, progress: bool = False, reference_padding: bool = False) -> None:
    """Fill out[rows] (default: every row) with the folded constants of those rows, block by block
    (frames (n, f, d) float16 memmap or int8 QuantFrames, masks (n, f), units (n, d), norms (n,)); on the GPU
    when present."""
    dev = _default_device(device)
    fw = fold.to(dev)
    rows = np.arange(out.shape[0]) if rows is None else np.asarray(rows, dtype=np.int64)
    starts = tqdm(range(0, rows.size, _BLOCK), desc="psi constants", unit="block", disable=not progress)
    for s0 in starts:
        r = rows[s0 : s0 + _BLOCK]
        contiguous = r.size and int(r[-1]) - int(r[0]) + 1 == r.size
        sl = slice(int(r[0]), int(r[-1]) + 1) if contiguous else r
        fr = torch.from_numpy(np.array(frames[sl])).to(dev)
        mk = torch.from_numpy(np.array(masks[sl])).to(dev)
        vb = torch.from_numpy(np.asarray(units[sl], dtype=np.float32) * np.asarray(norms[sl], dtype=np.float32)[:, None]).to(dev)
        out[sl] = fold_videos(fr, mk, fw, vbar=vb, reference_padding=reference_padding).packed.cpu().numpy()


def manifest_entry(fold: PsiFold, f: int, checkpoint_sha: str | None) -> dict[str, Any]:
    w = packed_width(f)
    return {"fingerprint": fold.fingerprint, "checkpoint_sha256": checkpoint_sha, "floats_per_video": w,
            "bytes_per_video": 4 * w, "dtype": "float32", "vbar": "norms*units", "file": f"{PSI_CONSTS_ARRAY}.npy"}


def attach(arrays: dict[str, Any], model: PsiModel, prev: PsiVersion | None = None, *, checkpoint_sha: str | None = None,
           staging: Path | None = None, device: torch.device | str | None = None) -> dict[str, Any]:
    """Add ``arrays["psi_consts"]`` for a version about to be written; return its manifest entry.

    Rows carried over from `prev` (same id, same norm, constants valid for this psi) are copied; the others
    are folded (on the GPU when present). With `staging` the array is a .npy memmap there (an
    ExistingFile for write_version), so a 1M-video index never holds its 3.4 GB of constants in memory.
    """
    def val(x: Any) -> Any:
        return np.load(x.path, mmap_mode="r", allow_pickle=False) if isinstance(x, ExistingFile) else x

    fold = fold_of(model)
    # int8 frames (with frame_scales) read as float32: an int8 index's constants are folded from its stored frames
    frames = frames_view(arrays)
    masks, units, norms = (val(arrays[k]) for k in ("masks", "units", "norms"))
    ids = np.asarray(val(arrays["ids"]), dtype=np.int64)
    n, f = frames.shape[0], frames.shape[1]
    w = packed_width(f)
    path = None
    if staging is not None:
        staging.mkdir(parents=True, exist_ok=True)
        path = staging / f"{PSI_CONSTS_ARRAY}.npy"
        # space reserved up front: writing a sparse memmap on a full disk would kill the process with SIGBUS
        out = alloc_npy(path, np.float32, (n, w))
    else:
        out = np.empty((n, w), np.float32)
    todo = np.arange(n)
    if prev is not None and n and fold_status(prev, fold) is None:
        prow = prev.rows(ids, missing="mask")
        ok = prow >= 0
        ok[ok] = np.asarray(prev.norms)[prow[ok]] == np.asarray(norms)[ok]  # same id, same content
        dst = np.flatnonzero(ok)
        for s0 in range(0, dst.size, _BLOCK):
            d = dst[s0 : s0 + _BLOCK]
            out[d] = prev.psi_consts[np.sort(prow[d])][np.argsort(np.argsort(prow[d]))]
        todo = np.flatnonzero(~ok)
        log.info("psi constants: %d rows carried from %s, %d to fold", dst.size, prev.name, todo.size)
    if todo.size:
        compute_rows(fold, frames, masks, units, norms, out, todo, device=device, progress=todo.size > 4 * _BLOCK,
                     reference_padding=reference_padding(model))
    if path is not None:
        out.flush()
        del out
        arrays[PSI_CONSTS_ARRAY] = ExistingFile(path)
    else:
        arrays[PSI_CONSTS_ARRAY] = out
    return manifest_entry(fold, f, checkpoint_sha)


def carry(arrays: dict[str, Any], prev: PsiVersion, src_rows: np.ndarray) -> dict[str, Any] | None:
    """Rows `src_rows` of prev's constants for a derived version (remove); its manifest entry or None."""
    if prev.psi_consts is None or not prev.manifest.psi_fold:
        return None
    src = np.asarray(src_rows, dtype=np.int64)
    arrays[PSI_CONSTS_ARRAY] = np.asarray(prev.psi_consts[src], dtype=np.float32).reshape(src.size, -1)
    return dict(prev.manifest.psi_fold)


# ------------------------------------------------------------------------------------------ serving
def fold_status(version: PsiVersion, fold: PsiFold) -> str | None:
    """None when `version` stores constants valid for these psi weights, else why not (one line)."""
    info = version.manifest.psi_fold
    if version.psi_consts is None or not info:
        return f"index version {version.name} has no psi constants (written before they existed); run `gare-index upgrade --out {version.root}`"
    if info.get("fingerprint") != fold.fingerprint:
        return (f"index version {version.name} holds psi constants of other psi weights ({str(info.get('fingerprint'))[:12]}, "
                f"served psi {fold.fingerprint[:12]}): stale; run `gare-index upgrade --out {version.root}`")
    ck = version.manifest.checkpoint_sha256
    if info.get("checkpoint_sha256") not in (None, ck):
        return f"index version {version.name}: psi constants were folded for checkpoint {info.get('checkpoint_sha256')}, the index is bound to {ck}"
    if version.psi_consts.shape[1] != packed_width(version.max_frames):
        return f"index version {version.name}: psi constants have width {version.psi_consts.shape[1]}, expected {packed_width(version.max_frames)}"
    return None


_IN_MEMORY: weakref.WeakKeyDictionary[PsiVersion, tuple[str, np.ndarray]] = weakref.WeakKeyDictionary()
_IN_MEMORY_LOCK = threading.Lock()  # one fold per version even when several request threads meet it first


def served(model: PsiModel, version: PsiVersion) -> np.ndarray:
    """The psi constants the search reads for `version` (n, W) float32: the stored ones when they are valid for
    model.psi, else constants folded in memory now, once per version and psi (one WARNING naming
    `gare-index upgrade`, which stores them). The folded array lives as long as the version object."""
    fold = fold_of(model)
    why = fold_status(version, fold)
    if why is None:
        return version.psi_consts
    with _IN_MEMORY_LOCK:
        hit = _IN_MEMORY.get(version)
        if hit is not None and hit[0] == fold.fingerprint:
            return hit[1]
        w = packed_width(version.max_frames)
        log.warning("psi rerank: %s; folding the constants of its %d videos in memory (%.1f MB; "
                    "`gare-index upgrade` stores them in the index)", why, version.n, 4 * w * version.n / 2**20)
        out = np.empty((version.n, w), np.float32)
        compute_rows(fold, version.frames, version.masks, version.units, version.norms, out,
                     device=getattr(model, "device", None), progress=version.n > 4 * _BLOCK,
                     reference_padding=reference_padding(model))
        _IN_MEMORY[version] = (fold.fingerprint, out)
        return out


def gather(version: PsiVersion, rows: np.ndarray, fold: PsiFold, device: torch.device | str, *, consts: np.ndarray | None = None) -> VideoConstants:
    """Constants of index rows (ascending, unique: memmap friendly) as VideoConstants on `device`, with the
    served v̄ = norm * unit. `consts`: the version's served constants (:func:`served`); default the stored
    ones (fold_status(version, fold) must then be None)."""
    fr = torch.from_numpy(np.ascontiguousarray(version.frames[rows]))
    pk = torch.from_numpy(np.ascontiguousarray((version.psi_consts if consts is None else consts)[rows]))
    vb = torch.from_numpy(np.asarray(version.units[rows], dtype=np.float32) * np.asarray(version.norms[rows], dtype=np.float32)[:, None])
    return VideoConstants(frames=fr, packed=pk, fingerprint=fold.fingerprint, vbar=vb).to(device)


def block(version: PsiVersion, s0: int, s1: int, fold: PsiFold, device: torch.device | str, *, stored: bool,
          reference_padding: bool = False) -> VideoConstants:
    """Rows s0:s1 as VideoConstants on `device`: the stored constants, or (stored=False) folded now."""
    fr = torch.from_numpy(np.array(version.frames[s0:s1])).to(device)
    vb = torch.from_numpy(_vbar(version.units, version.norms, s0, s1)).to(device)
    if stored:
        pk = torch.from_numpy(np.array(version.psi_consts[s0:s1])).to(device)
        return VideoConstants(frames=fr, packed=pk, fingerprint=fold.fingerprint, vbar=vb)
    mk = torch.from_numpy(np.array(version.masks[s0:s1])).to(device)
    return fold_videos(fr, mk, fold.to(device), vbar=vb, reference_padding=reference_padding)


# ------------------------------------------------------------------------------------------ verify
def problems(version: PsiVersion, *, sample: int = 64, seed: int = 0, model: PsiModel | None = None) -> list[str]:
    """Checks of the stored constants: manifest entry, shape, finite values, and (given the model, or the
    index's checkpoint when it is readable) a recomputation of `sample` random rows (atol 1e-4)."""
    info = version.manifest.psi_fold
    has = version.psi_consts is not None
    if not has and not info:
        log.warning("index version %s has no psi constants: the search folds them in memory when it loads it; "
                    "`gare-index upgrade --out %s` adds them", version.name, version.root)
        return []
    if has != bool(info):
        return [f"{PSI_CONSTS_ARRAY}.npy and manifest '{MANIFEST_KEY}' must go together (file {'present' if has else 'missing'})"]
    out = []
    w = packed_width(version.max_frames)
    if version.psi_consts.shape != (version.n, w) or int(info.get("floats_per_video", -1)) != w:
        out.append(f"{PSI_CONSTS_ARRAY}.npy: shape {version.psi_consts.shape}, manifest {info.get('floats_per_video')}, expected ({version.n}, {w})")
        return out
    ck = version.manifest.checkpoint_sha256
    if info.get("checkpoint_sha256") not in (None, ck):
        out.append(f"{PSI_CONSTS_ARRAY}.npy: folded for checkpoint {info.get('checkpoint_sha256')}, index bound to {ck}")
    f = version.max_frames
    for s0 in range(0, version.n, 65536):
        blk = np.asarray(version.psi_consts[s0 : s0 + 65536])
        body = np.concatenate([blk[:, :f], blk[:, 2 * f :]], axis=1)  # the frame-bias field is 0 / -inf
        if not np.all(np.isfinite(body)) or not np.all(np.isin(blk[:, f : 2 * f], (0.0, -np.inf))):
            out.append(f"{PSI_CONSTS_ARRAY}.npy: non-finite values (rows {s0}..)")
            break
    if model is None:
        path = (version.manifest.checkpoint.path if version.manifest.checkpoint else None)
        if not path or not Path(path).is_file():
            log.warning("verify: checkpoint %s not readable; psi constants not recomputed", path)
            return out
        if file_sha256(path) != ck:
            log.warning("verify: %s changed since the index was built; psi constants not recomputed", path)
            return out
        model, _ = load_model(path, "cpu")
    fold = fold_of(model)
    if fold.fingerprint != info.get("fingerprint"):
        out.append(f"{PSI_CONSTS_ARRAY}.npy: fingerprint {str(info.get('fingerprint'))[:12]} is not the checkpoint's psi ({fold.fingerprint[:12]})")
        return out
    if version.n:
        rows = np.sort(np.random.default_rng(seed).choice(version.n, size=min(sample, version.n), replace=False))
        want = np.empty((rows.size, w), np.float32)
        sub = np.arange(rows.size)
        compute_rows(fold, version.frames[rows], version.masks[rows], version.units[rows], version.norms[rows], want, sub,
                     device="cpu", reference_padding=reference_padding(model))
        have = np.asarray(version.psi_consts[rows])
        fin = np.isfinite(want)
        if not (np.array_equal(fin, np.isfinite(have)) and np.allclose(have[fin], want[fin], rtol=1e-4, atol=1e-4)):
            bad = rows[~np.all(np.isclose(have, want, rtol=1e-4, atol=1e-4) | (~fin & (have == want)), axis=1)]
            out.append(f"{PSI_CONSTS_ARRAY}.npy: rows {bad[:10].tolist()} differ from a recomputation (stale or corrupt)")
    return out
