"""Verifying an index: the manifest's seal, file hashes, shapes, ids, FAISS contents and the folded NCL index
against the arrays; sealing a version written before seals (:func:`seal_version`).
"""

from __future__ import annotations

import logging
import os
import sqlite3
from pathlib import Path

import numpy as np

from gare.sinkhorn import fold_biases
from gare_index.ann import AnnIndex
from gare_index.psi_consts import problems as psi_problems
from gare_index.store.format import ANN_NCL_FILE, MANIFEST_FILE, VERSIONS_DIR, IndexFormatError, index_lock
from gare_index.store.reader import (
    IndexVersion,
    current_version_name,
    file_hash_problems,
    manifest_from_bytes,
    open_version,
)
from gare_index.store.seal import SEAL_FILE, seal_status, write_seal

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------ verify
def _faiss_ids(ann: AnnIndex) -> np.ndarray:
    """Every id stored in the FAISS index (IDMap id_map or IVF inverted lists)."""
    import faiss

    outer = faiss.downcast_index(ann.cpu_index)
    if isinstance(outer, faiss.IndexIDMap):
        return faiss.vector_to_array(outer.id_map).astype(np.int64)
    if isinstance(outer, faiss.IndexIVF):
        invlists = outer.invlists
        out = []
        for lst in range(outer.nlist):
            size = invlists.list_size(lst)
            if size:
                out.append(faiss.rev_swig_ptr(invlists.get_ids(lst), size).copy())
        return np.concatenate(out).astype(np.int64) if out else np.zeros(0, dtype=np.int64)
    raise IndexFormatError(f"cannot list the ids of a {type(outer).__name__}")


def _ncl_problems(v: IndexVersion) -> list[str]:
    """ann_ncl.faiss holds every id and, for a flat index, exactly [stage-1 vector ; b / c] (stale biases show)."""
    import faiss

    assert v.ann_ncl is not None
    try:
        fids = _faiss_ids(v.ann_ncl)
    except IndexFormatError as e:
        return [f"{ANN_NCL_FILE}: {e}"]
    ids = np.asarray(v.ids)
    if fids.size != v.n or not np.array_equal(np.sort(fids), np.sort(ids)):
        return [f"{ANN_NCL_FILE}: holds {fids.size} ids that differ from the {v.n} in ids.npy"]
    outer = faiss.downcast_index(v.ann_ncl.cpu_index)
    if v.n and isinstance(outer, faiss.IndexIDMap) and isinstance(faiss.downcast_index(outer.index), faiss.IndexFlat):
        stored = faiss.downcast_index(outer.index).reconstruct_n(0, v.n)
        rows = v.rows(fids)
        want = fold_biases(np.asarray(v.stage1_units[rows], np.float32), np.asarray(v.biases)[rows], v.ncl_c)
        if not np.allclose(stored, want, atol=1e-6):
            return [f"{ANN_NCL_FILE}: its vectors are not [stage-1 vector ; bias / c] of this version (stale biases?)"]
    return []


def verify_index(
    root: str | os.PathLike,
    *,
    name: str | None = None,
    rehash: bool = True,
    expect_checkpoint_sha: str | None = None,
    check_files: bool = False,
    psi_sample: int = 64,
) -> list[str]:
    """Problems found in a version (CURRENT by default); an empty list means it is consistent.

    Checks: the manifest's seal first (a version without one is not a problem: :func:`gare_index.store.seal_status`
    tells, :func:`seal_version` seals it), manifest, file sizes and (rehash) sha256 and fast hash; array shapes and
    dtypes; ids unique and equal across ids.npy, FAISS and SQLite; norms positive and finite, units of unit length; at least one frame per
    video; padded frame rows zero, or, for a checkpoint with ``reference_padding``, holding their features
    with v̄ = norm * unit the mean over all rows of the stored frames; biases finite; psi's constants (psi_consts.npy): shape,
    fingerprint, finite, and `psi_sample` random rows recomputed with the index's checkpoint when readable. `check_files` also re-checks every indexed video
    file's size and mtime on disk (a changed file is reported, not an error of the index itself).
    """
    root = Path(root)
    problems: list[str] = []
    try:
        name = name or current_version_name(root)
        if not rehash:  # the rehash checks the seal first (open_version(verify=True)); a quick verify does it here
            seal = seal_status(root / VERSIONS_DIR / name)
            problems += [] if seal.ok else [seal.problem]
        v = open_version(root, name, verify=rehash, expect_checkpoint_sha=expect_checkpoint_sha, use_gpu=False)
    except IndexFormatError as e:
        return [*problems, str(e)]
    with v:
        n = v.n
        ids = np.asarray(v.ids)
        if np.unique(ids).size != n:
            problems.append(f"ids.npy: {n - np.unique(ids).size} duplicate ids")
        if n > 1 and not np.all(np.diff(ids) > 0):
            problems.append("ids.npy: ids are not in ascending order")
        try:
            fids = _faiss_ids(v.ann)
            if fids.size != n or not np.array_equal(np.sort(fids), np.sort(ids)):
                problems.append(f"ann.faiss: holds {fids.size} ids that differ from the {n} in ids.npy")
        except IndexFormatError as e:
            problems.append(str(e))
        if v.ann_ncl is not None:
            problems += _ncl_problems(v)
        problems += psi_problems(v, sample=psi_sample)
        try:
            meta = v.all_metadata()
        except sqlite3.Error as e:
            problems.append(f"meta.sqlite: {e}")
            meta = []
        else:
            mids = np.array([m["id"] for m in meta], dtype=np.int64)
            if mids.size != n or not np.array_equal(np.sort(mids), np.sort(ids)):
                problems.append(f"meta.sqlite: {mids.size} rows whose ids differ from the {n} in ids.npy")
        norms = np.asarray(v.norms)
        if n and not (np.all(np.isfinite(norms)) and np.all(norms > 0)):
            problems.append("norms.npy: non-positive or non-finite norms")
        step = 65536
        for s in range(0, n, step):
            u = np.asarray(v.units[s : s + step], dtype=np.float64)
            if not np.all(np.abs(np.linalg.norm(u, axis=1) - 1.0) < 1e-3):
                problems.append(f"units.npy: rows {s}..{s + len(u) - 1} include vectors that are not unit length")
                break
        if v.ann_units is not None:
            for s in range(0, n, step):
                u = np.asarray(v.ann_units[s : s + step], dtype=np.float64)
                if not (np.all(np.isfinite(u)) and np.all(np.abs(np.linalg.norm(u, axis=1) - 1.0) < 1e-3)):
                    problems.append(f"ann_units.npy: rows {s}..{s + len(u) - 1} include vectors that are not finite unit vectors")
                    break
        masks = np.asarray(v.masks)
        if n and masks.sum(axis=1).min() < 1:
            problems.append("masks.npy: some videos have no frame")
        rp = v.reference_padding
        for s in range(0, n, 4096):
            fr = np.asarray(v.frames[s : s + 4096])
            pad = masks[s : s + 4096] == 0
            if not rp and pad.any() and np.abs(fr[pad]).max() > 0:
                problems.append(f"frames.npy: padded frame rows are not zero (rows {s}..)")
                break
            if rp and pad.any() and (np.abs(fr[pad]).max(axis=-1) == 0).any():
                problems.append(f"frames.npy: padded frame rows are zero, but the checkpoint has reference_padding "
                                f"(its scores need those rows' features; rows {s}..)")
                break
            if rp and fr.size:
                # v̄ must be the all-rows mean of the stored frames (float16 storage: ~5e-4 of the frames' scale)
                f32 = fr.astype(np.float32)
                err = np.abs(f32.mean(axis=1) - v.vbar(np.arange(s, s + len(fr)))).max(axis=1)
                # int8 frames: each value within scale / 2 = max / 254 of the encoder's, so the mean too
                tol = 2e-3 + (1 / 254 if v.frame_scales is not None else 0.0)
                if (err > tol * np.maximum(np.abs(f32).max(axis=(1, 2)), 1e-6)).any():
                    problems.append(f"norms.npy/units.npy: v̄ is not the mean over all rows of frames.npy, as "
                                    f"reference_padding requires (rows {s}..)")
                    break
            if not np.all(np.isfinite(fr)):
                problems.append(f"frames.npy: non-finite values (rows {s}..)")
                break
            sc = None if v.frame_scales is None else np.asarray(v.frame_scales[s : s + 4096])
            if sc is not None and not (np.all(np.isfinite(sc)) and (sc >= 0).all()):
                problems.append(f"frame_scales.npy: negative or non-finite scales (rows {s}..)")
                break
        if not np.all(np.isfinite(np.asarray(v.biases))):
            problems.append("biases.npy: non-finite biases")
        if meta and v.manifest.n != len(meta):
            problems.append(f"manifest.json: n={v.manifest.n} but meta.sqlite has {len(meta)} rows")
        if meta:
            fu = {int(m["id"]): m.get("frames_used") for m in meta}
            rows = v.rows(ids)
            used = masks[rows].sum(axis=1)
            bad = [int(i) for i, u in zip(ids, used, strict=True) if fu.get(int(i)) is not None and fu[int(i)] != int(u)]
            if bad:
                problems.append(f"meta.sqlite: frames_used disagrees with masks.npy for ids {bad[:10]}")
        if check_files:
            for m in meta:
                p = Path(m["path"])
                try:
                    st = p.stat()
                except OSError:
                    problems.append(f"video {m['id']}: {p} is gone")
                    continue
                if st.st_size != m["size"] or abs(st.st_mtime - float(m["mtime"])) > 1e-6:
                    problems.append(f"video {m['id']}: {p} changed since it was indexed")
    return problems


def seal_version(root: str | os.PathLike, name: str | None = None) -> str:
    """Seal a version written before seals (CURRENT's by default): every file re-hashed against both hashes its
    manifest records, then the seal of the manifest's bytes written (gare_index.store.seal). Returns "sealed", or
    "already sealed" for a version whose seal matches; IndexFormatError naming every problem (nothing written)
    when a file or the existing seal does not match."""
    root = Path(root)
    name = name or current_version_name(root)
    vdir = root / VERSIONS_DIR / name
    mpath = vdir / MANIFEST_FILE
    try:
        data = mpath.read_bytes()
    except FileNotFoundError:
        raise IndexFormatError(f"{mpath}: missing") from None
    seal = seal_status(vdir, data)
    if seal.state == "sealed":
        return "already sealed"
    if seal.state == "bad":
        raise IndexFormatError(f"{seal.problem}; not sealing: restore the manifest, or remove {SEAL_FILE} only if "
                               "manifest.json is known to be right")
    manifest = manifest_from_bytes(mpath, data)
    problems = file_hash_problems(vdir, manifest.files, rehash=True)
    if problems:
        raise IndexFormatError(f"index version {name} not sealed, its files do not match its manifest: "
                               + "; ".join(problems))
    with index_lock(root):  # not while a writer's gc removes the version
        if not vdir.is_dir() or mpath.read_bytes() != data:
            raise IndexFormatError(f"{vdir}: removed or rewritten while it was verified; not sealed")
        write_seal(vdir, data)
    log.info("sealed index version %s (%s)", name, vdir / SEAL_FILE)
    return "sealed"
