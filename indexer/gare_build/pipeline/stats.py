"""`gare-index stats`: what the current version holds, and the bytes it and the other versions take."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from gare_index.fields import BUILTIN_FIELDS
from gare_index.store import MANIFEST_FILE, VERSIONS_DIR, WORK_DIR, list_versions, open_index


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def stats(out: str | os.PathLike) -> dict[str, Any]:
    """`gare-index stats`: the current version's figures (manifest, counts, sizes on disk) as a JSON-able dict."""
    root = Path(out).expanduser().absolute()
    with open_index(root, use_gpu=False) as v:
        m = v.manifest
        files = {k: x.bytes for k, x in m.files.items()}
        total = sum(files.values())
        meta = v.all_metadata()
        n = v.n
        return {
            "index": str(root),
            "version": v.name,
            "versions": list_versions(root),
            "created": m.created,
            "n": n,
            "distinct_files": len({r["path"] for r in meta}),
            "segments": sum(1 for r in meta if r["start"] is not None or r["end"] is not None),
            "total_duration_s": round(sum(float(r["duration"] or 0) for r in meta if r["start"] is None)
                                      + sum(float(r["end"] - r["start"]) for r in meta if r["start"] is not None and r["end"] is not None), 3),
            "dim": v.dim,
            "max_frames": v.max_frames,
            "mean_frames_used": round(float(np.asarray(v.masks).sum(axis=1).mean()), 3) if n else 0.0,
            "index_type": m.index_type,
            "index_type_requested": m.index_type_requested,
            "ann_params": m.ann_params,
            "kv": m.kv,
            # padded rows: features kept, v̄ over all rows, psi attends to them (checkpoints imported from the authors)
            "reference_padding": v.reference_padding,
            "precision": m.precision,
            "checkpoint": None if m.checkpoint is None else m.checkpoint.path,
            "checkpoint_sha256": m.checkpoint_sha256,
            "biases": m.biases,
            "invgc": None if not m.invgc else {k: v for k, v in m.invgc.items() if k != "selection"}
            | {"selection": {k: v for k, v in (m.invgc.get("selection") or {}).items() if k != "tried"}},
            "ncl_stage1": m.ncl_stage1,
            "stage1": None if not m.stage1 else {k: v for k, v in m.stage1.items() if k != "trials"},
            "default_candidates": (m.stage1 or {}).get("default_candidates"),
            "bytes": files,
            "bytes_total": total,
            "bytes_per_video": round(total / n, 1) if n else None,
            "work_bytes": _dir_bytes(root / WORK_DIR) if (root / WORK_DIR).is_dir() else 0,
            "all_versions_bytes": _dir_bytes(root / VERSIONS_DIR),
            "manifest": str(v.path / MANIFEST_FILE),
            # the library's own fields (name -> type) and how many videos have a value of each; the built-in ones
            "fields": ", ".join(f"{k}:{t}" for k, t in (m.fields or {}).items()) or "none",
            "field_values": {k: sum(1 for r in meta if r.get(k) is not None) for k in (m.fields or {})},
            "builtin_fields": dict(BUILTIN_FIELDS),
        }
