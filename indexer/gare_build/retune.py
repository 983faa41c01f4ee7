"""`gare-index tune`: re-run the stage-1 tuning (:mod:`gare_build.tuning.version_tuning`) on the current version, nothing re-encoded.

The new version links every array and the metadata of the current one; only ann.faiss (re-tuned knobs, or
another index type when the current one cannot meet the target) and the manifest's ``stage1`` entry change
(ann_ncl.faiss, when present, is rebuilt to the new parameters by write_version). A run that fails (target
not met, bad input) leaves the current version as it is.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from gare.checkpoint import file_sha256, load_model
from gare_build.build import carry_manifest, prev_files, reported
from gare_build.pipeline.biases import checkpoint_gamma_and_queue
from gare_build.pipeline.options import BUILD_LOCK, RunReport, progress_enabled
from gare_build.tuning.version_tuning import Stage1Options, encode_captions, stored_consts, tune_version_ann
from gare_index.describe import STAGE1_KEY, index_ncl_default
from gare_index.store import ExistingFile, IndexMismatchError, index_lock, open_index, write_version
from gare_search.search import NCL_DEFAULT

log = logging.getLogger(__name__)


def retune(out: str | os.PathLike, *, options: Stage1Options | None = None, checkpoint: str | os.PathLike | None = None,
           captions: Sequence[str] | None = None, index_type: str | None = None, keep: int = 3,
           progress: bool | None = None) -> RunReport:
    """Tune stage 1 of INDEX's current version again and write the result as a new version (atomic switch)."""
    root = Path(out).expanduser().absolute()
    report = RunReport(command="tune", index=str(root))
    opts = options or Stage1Options()
    with reported(root, report):
        opts.validate()
        with index_lock(root, BUILD_LOCK, blocking=False):
            prev = open_index(root, use_gpu=False)
            report.previous_version = prev.name
            m = prev.manifest
            ck = Path(checkpoint or (m.checkpoint.path if m.checkpoint else None) or "")
            if not ck.is_file():
                raise ValueError(f"checkpoint {ck} not found; give --checkpoint (the one the index was built with)")
            sha = file_sha256(ck)
            if sha != prev.checkpoint_sha256:
                raise IndexMismatchError(f"{ck} has sha256 {sha}; index {root} was built with {prev.checkpoint_sha256}")
            model, ckpt = load_model(ck, "cpu")
            _, queue = checkpoint_gamma_and_queue(ckpt, raw=True)  # raw rows: psi needs |t|
            caps = encode_captions(model, list(captions)) if captions else None
            requested = index_type or m.index_type_requested or "auto"
            units = prev.stage1_units
            # K for the score served by default: psi + b only when the index's NCL default is on (the biases can be off)
            ncl_on = (index_ncl_default(m) or (NCL_DEFAULT,))[0]
            ann, entry = tune_version_ann(
                units, np.asarray(prev.ids), frames=prev.frames, masks=prev.masks,
                biases=prev.biases if ncl_on else np.zeros(prev.n, np.float32), model=model,
                queue=queue, captions=caps, ann=prev.ann, requested_type=requested, options=opts,
                progress=progress_enabled(progress), stored=stored_consts(prev, model),
            )
            # every array but the ANN is the current version's, psi's stored constants included (the manifest's
            # psi_fold entry is carried with them: without the file each server would fold every video at start)
            arrays = prev_files(prev, ["ids", "norms", "units", "frames", "masks", "biases", "keys", "values",
                                        "ann_units", "psi_consts"])
            files = m.files
            same = ann.cpu_index is prev.ann.cpu_index
            extra = carry_manifest(m) | {
                "ann_params": ann.params.to_dict(), STAGE1_KEY: {**entry, "ncl_default": ncl_on},
                "builder": {"command": "tune"},
                "ann_trained_n": m.ann_trained_n if same else prev.n,
            }
            if requested != m.index_type_requested:
                extra["index_type_requested"] = requested
            ncl = m.ncl_stage1
            if ncl:  # rebuilt by write_version over [stage-1 ; b / c] with the new main parameters
                extra["ncl_stage1"] = {k: v for k, v in ncl.items() if k in ("c",)}
            name = write_version(root, arrays, ExistingFile(prev.path / "meta.sqlite", files["meta.sqlite"].sha256),
                                 extra, ann=ann, keep=keep)
            report.version, report.n_videos, report.stage1 = name, prev.n, entry
            report.index_type = ann.params.index_type
            report.biases = m.biases or {}
            prev.close()
    return report
