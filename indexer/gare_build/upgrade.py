"""`gare-index upgrade`: bring the current version up to this gare-index's format.

Today that means adding psi's per-video constants (``psi_consts.npy`` + the manifest's ``psi_fold``, see
:mod:`gare_index.psi_consts`) to a version written before they existed, or replacing stale ones. The new
version hard-links every other file of the current one and is written like any other (temp directory,
rename, atomic CURRENT switch), so a crash leaves the previous version current.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from gare.checkpoint import file_sha256, load_model
from gare_build.build import carry_manifest, prev_files, reported
from gare_build.pipeline.options import BUILD_LOCK, RunReport
from gare_index import psi_consts
from gare_index.store import (
    ANN_NCL_FILE,
    WORK_DIR,
    CheckpointRef,
    ExistingFile,
    IndexMismatchError,
    index_lock,
    open_index,
    write_version,
)

log = logging.getLogger(__name__)


def upgrade(out: str | os.PathLike, *, checkpoint: str | os.PathLike | None = None, keep: int = 3,
            device: str | None = None, force: bool = False) -> RunReport:
    """Write a version with valid psi constants; no new version when they are already valid (unless `force`)."""
    root = Path(out).expanduser().absolute()
    report = RunReport(command="upgrade", index=str(root))
    with reported(root, report):
        with index_lock(root, BUILD_LOCK, blocking=False):
            prev = open_index(root, use_gpu=False)
            report.previous_version = prev.name
            ck = prev.manifest.checkpoint or CheckpointRef()
            path = Path(checkpoint or ck.path or "")
            if not path.is_file():
                raise ValueError(f"checkpoint {path} not found; pass --checkpoint (the one the index was built with)")
            sha = file_sha256(path)
            if sha != ck.sha256:
                raise IndexMismatchError(f"{path} has sha256 {sha}; index {prev.name} was built with {ck.sha256}")
            dev = psi_consts._default_device(device)
            model, _ = load_model(path, dev)
            why = psi_consts.fold_status(prev, psi_consts.fold_of(model))
            if why is None and not force:
                report.notes.append(f"{prev.name} already stores valid psi constants: nothing to do")
                report.n_videos = prev.n
            else:
                log.info("upgrading %s: %s", prev.name, why or "forced")
                arrays = prev_files(prev, ["ids", "norms", "units", "frames", "masks", "biases", "keys", "values",
                                            "ann_units", "frame_scales"])  # int8 frames keep their scales
                staging = root / WORK_DIR / f".staging-upgrade-{os.getpid()}"
                try:
                    entry = psi_consts.attach(arrays, model, None, checkpoint_sha=sha, staging=staging, device=dev)
                    files = prev.manifest.files
                    extra = carry_manifest(prev.manifest) | {"psi_fold": entry, "builder": {"command": "upgrade"}}
                    ann_ncl = (ExistingFile(prev.path / ANN_NCL_FILE, files[ANN_NCL_FILE].sha256)
                               if ANN_NCL_FILE in files else None)
                    name = write_version(
                        root, arrays, ExistingFile(prev.path / "meta.sqlite", files["meta.sqlite"].sha256), extra,
                        ann=ExistingFile(prev.path / "ann.faiss", files["ann.faiss"].sha256), keep=keep, ann_ncl=ann_ncl,
                    )
                finally:
                    shutil.rmtree(staging, ignore_errors=True)
                report.version, report.n_videos = name, prev.n
            report.index_type = prev.manifest.index_type
            prev.close()
    return report
