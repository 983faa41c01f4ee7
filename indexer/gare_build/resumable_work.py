"""INDEX/work/: per-clip encoded features that survive a killed run (never read by the service).

Features depend on the checkpoint, the precision and the clip (file content + window), so they live in
``work/<sha256[:16]>-<precision>/`` and are keyed by ``"<file sha256>|<start>|<end>"``. Each encoded
batch is one ``shard-*.npz`` (keys, frames float16, vbar float32, masks uint8) written to a temporary
name, fsynced and renamed: a shard is either complete or absent, so a SIGKILL loses at most the batch in
flight. The cache of a model is deleted once a version holding its features is current.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gare.atomic import atomic_write
from gare_index.store import WORK_DIR, atomic_write_text

log = logging.getLogger(__name__)


def model_key(checkpoint_sha: str, precision: str) -> str:
    return f"{checkpoint_sha[:16]}-{precision}"


@dataclass
class Shard:
    keys: list[str]
    frames: np.ndarray  # (b, f, d) float16
    vbar: np.ndarray  # (b, d) float32
    masks: np.ndarray  # (b, f) uint8


def units_norms(vbar: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(unit vectors float32, norms float32) from v̄; the one definition used by every engine."""
    v = np.asarray(vbar, dtype=np.float32)
    norms = np.linalg.norm(v.astype(np.float64), axis=1)
    units = (v.astype(np.float64) / np.maximum(norms, 1e-30)[:, None]).astype(np.float32)
    return units, norms.astype(np.float32)


class WorkCache:
    def __init__(self, root: str | os.PathLike, key: str, *, info: dict | None = None) -> None:
        self.dir = Path(root) / WORK_DIR / key
        self.dir.mkdir(parents=True, exist_ok=True)
        if info is not None and not (self.dir / "MODEL.json").exists():
            atomic_write_text(self.dir / "MODEL.json", json.dumps(info, indent=1, default=str))
        self._index: dict[str, tuple[Path, int]] | None = None

    def index(self) -> dict[str, tuple[Path, int]]:
        """key -> (shard file, row) for every complete shard on disk (unreadable shards are ignored)."""
        if self._index is None:
            idx: dict[str, tuple[Path, int]] = {}
            for p in sorted(self.dir.glob("shard-*.npz")):
                try:
                    with np.load(p, allow_pickle=False) as z:
                        keys = [str(k) for k in z["keys"]]
                except Exception as e:  # noqa: BLE001 - a damaged shard is just re-encoded
                    log.warning("ignoring unreadable work shard %s (%s)", p, e)
                    continue
                for i, k in enumerate(keys):
                    idx[k] = (p, i)
            self._index = idx
        return self._index

    def __contains__(self, key: str) -> bool:
        return key in self.index()

    def put(self, shard: Shard) -> Path:
        """Write one shard atomically (temp file, fsync, rename); returns its path."""
        if not shard.keys:
            raise ValueError("empty shard")
        name = f"shard-{uuid.uuid4().hex}.npz"
        final = self.dir / name

        def write(tmp: str) -> None:
            with open(tmp, "wb") as fh:
                np.savez(
                    fh,
                    keys=np.array(shard.keys, dtype=str),
                    frames=np.asarray(shard.frames, dtype=np.float16),
                    vbar=np.asarray(shard.vbar, dtype=np.float32),
                    masks=np.asarray(shard.masks, dtype=np.uint8),
                )

        atomic_write(final, write)  # temp name in the same folder, fsync, rename, fsync the folder
        idx = self.index()
        for i, k in enumerate(shard.keys):
            idx[k] = (final, i)
        return final

    def load(self, path: Path) -> Shard:
        with np.load(path, allow_pickle=False) as z:
            return Shard([str(k) for k in z["keys"]], z["frames"], z["vbar"], z["masks"])

    def clear(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        self._index = {}
