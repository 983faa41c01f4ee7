"""`gare-index stats`: what the current version holds, and the bytes it and the other versions take."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from ..stage1_tune import STAGE1_KEY
from ..store import MANIFEST_FILE, VERSIONS_DIR, WORK_DIR, open_index


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def stats(out: str | os.PathLike) -> dict[str, Any]:
    from ..store import list_versions

    root = Path(out).expanduser().absolute()
    with open_index(root, use_gpu=False) as v:
        m = v.manifest
        files = {k: int(x["bytes"]) for k, x in m["files"].items()}
        total = sum(files.values())
        meta = v.all_metadata()
        n = v.n
        return {
            "index": str(root),
            "version": v.name,
            "versions": list_versions(root),
            "created": m.get("created"),
            "n": n,
            "distinct_files": len({r["path"] for r in meta}),
            "segments": sum(1 for r in meta if r["start"] is not None or r["end"] is not None),
            "total_duration_s": round(sum(float(r["duration"] or 0) for r in meta if r["start"] is None)
                                      + sum(float(r["end"] - r["start"]) for r in meta if r["start"] is not None and r["end"] is not None), 3),
            "dim": v.dim,
            "max_frames": v.max_frames,
            "mean_frames_used": round(float(np.asarray(v.masks).sum(axis=1).mean()), 3) if n else 0.0,
            "index_type": m.get("index_type"),
            "index_type_requested": m.get("index_type_requested"),
            "ann_params": m.get("ann_params"),
            "kv": bool(m.get("kv")),
            # padded rows: features kept, v̄ over all rows, psi attends to them (checkpoints imported from the authors)
            "reference_padding": v.reference_padding,
            "precision": m.get("precision"),
            "checkpoint": m.get("checkpoint", {}).get("path"),
            "checkpoint_sha256": m.get("checkpoint", {}).get("sha256"),
            "biases": m.get("biases"),
            "invgc": None if not m.get("invgc") else {k: v for k, v in m["invgc"].items() if k != "selection"}
            | {"selection": {k: v for k, v in (m["invgc"].get("selection") or {}).items() if k != "tried"}},
            "ncl_stage1": m.get("ncl_stage1"),
            "stage1": None if not m.get(STAGE1_KEY) else {k: v for k, v in m[STAGE1_KEY].items() if k != "trials"},
            "default_candidates": (m.get(STAGE1_KEY) or {}).get("default_candidates"),
            "bytes": files,
            "bytes_total": total,
            "bytes_per_video": round(total / n, 1) if n else None,
            "work_bytes": _dir_bytes(root / WORK_DIR) if (root / WORK_DIR).is_dir() else 0,
            "all_versions_bytes": _dir_bytes(root / VERSIONS_DIR),
            "manifest": str(v.path / MANIFEST_FILE),
        }
