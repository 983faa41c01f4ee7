"""The on-disk index format (a contract with the service) and its reader and writers.

Layout (see docs/index-format.md)::

    INDEX/
      CURRENT                      the current version's directory name ("v000003"), switched atomically
      versions/v000003/            immutable once renamed into place
         manifest.json             format, version, checkpoint binding, shapes, ANN params, biases, file hashes
         manifest.json.xxh3        the seal: the fast hash of manifest.json's bytes (absent in older versions)
         ann.faiss                 FAISS index over the unit vectors, ids = video ids (int64)
         ids.npy (n,) int64        row order of every array below (ascending ids)
         norms.npy (n,) float32    |v̄|
         units.npy (n,d) float32   v̄/|v̄|
         frames.npy (n,f,d) float16 frame features F (padded rows zero, or their features when the
                                   checkpoint has reference_padding), opened with mmap_mode="r"; int8 with
                                   --frames-dtype int8 (manifest frame_dtype), read through QuantFrames
         frame_scales.npy (n,f) float32 int8 frames only: frame g of video j is scale[j, g] * frames[j, g]
                                   (gare_index.frame_quant; bench/results/frames_int8.md)
         masks.npy (n,f) uint8
         biases.npy (n,) float32   NCL video biases b_j (zeros when the checkpoint has no query queue)
         keys.npy, values.npy      optional (n,f,d) float16: psi's per-video K/V projections (--store-kv)
         ann_units.npy (n,d) float32 optional: InvGC-corrected stage-1 vectors (--invgc); ann.faiss is built on
                                   them instead of units.npy (see docs/postprocessing.md)
         ann_ncl.faiss             optional (--ncl-stage1): FAISS over [stage-1 vector ; b_j / c] (NCL biases folded)
         meta.sqlite               table videos(id, path, size, mtime, checksum, duration, fps, frames_used,
                                   start, end, status)
      work/                        resumable encoder state; never read by the service
      report.json                  the last run's skipped files with reasons

Readers: :func:`open_index` (the service), :func:`current_version_name`, :func:`list_versions`.
Writers: :func:`write_version` writes ``versions/.tmp-<name>``, fsyncs every file, renames the directory to
its final name and then switches ``CURRENT`` (temp file + ``os.replace``), so a reader sees either the old
version or the new one, and a writer killed at any moment leaves the previous version intact.
:func:`gc` removes old versions (never the current one).

Modules: :mod:`.format` (names, constants, errors, lock, file helpers), :mod:`.manifest` (manifest.json as
the typed :class:`IndexManifest`, checked at read and at write), :mod:`.reader` (opening a version), :mod:`.index_version` (the opened :class:`IndexVersion`), :mod:`.writer`, :mod:`.verify`,
:mod:`.fast_hash` (the fast file hash the manifest records), :mod:`.seal` (the manifest's own hash, beside it) and
:mod:`.file_check` (re-hashing a version's files before it is served: ``open_version(check=True)``). Import from ``gare_index.store``; the submodules are an implementation detail.
"""

from gare_index.npy_staging import ExistingFile
from gare_index.store.fast_hash import FAST_HASH_SCHEME
from gare_index.store.file_check import BackgroundCheck, CheckReport, IndexCheckError, check_files
from gare_index.store.format import (
    ANN_FILE,
    ANN_NCL_FILE,
    ARRAY_SPECS,
    CURRENT_FILE,
    FORMAT,
    FORMAT_VERSION,
    LOCK_FILE,
    MANIFEST_FILE,
    META_COLUMNS,
    META_FILE,
    OPTIONAL_ARRAYS,
    REPORT_FILE,
    VERSIONS_DIR,
    WORK_DIR,
    IndexFormatError,
    IndexMismatchError,
    atomic_write_text,
    index_lock,
    test_pause,
    version_name,
)
from gare_index.store.index_version import IndexVersion
from gare_index.store.manifest import (
    CheckpointRef,
    FileEntry,
    IndexManifest,
    Sampling,
    Segment,
    parse_manifest,
)
from gare_index.store.reader import (
    current_version_name,
    list_versions,
    open_index,
    open_version,
    read_manifest,
)
from gare_index.store.seal import SEAL_FILE, SealStatus, seal_status, write_sealed_manifest
from gare_index.store.verify import seal_version, verify_index
from gare_index.store.writer import gc, remove_stale_tmp, switch_current, write_version

__all__ = [  # every name importable from gare_index.store
    "FORMAT",
    "FORMAT_VERSION",
    "CURRENT_FILE",
    "VERSIONS_DIR",
    "WORK_DIR",
    "REPORT_FILE",
    "MANIFEST_FILE",
    "ANN_FILE",
    "ANN_NCL_FILE",
    "META_FILE",
    "LOCK_FILE",
    "ARRAY_SPECS",
    "OPTIONAL_ARRAYS",
    "META_COLUMNS",
    "IndexFormatError",
    "IndexMismatchError",
    "IndexCheckError",
    "FAST_HASH_SCHEME",
    "BackgroundCheck",
    "CheckReport",
    "check_files",
    "version_name",
    "test_pause",
    "atomic_write_text",
    "index_lock",
    "current_version_name",
    "list_versions",
    "read_manifest",
    "IndexManifest",
    "CheckpointRef",
    "FileEntry",
    "Sampling",
    "Segment",
    "parse_manifest",
    "IndexVersion",
    "open_version",
    "open_index",
    "ExistingFile",
    "remove_stale_tmp",
    "switch_current",
    "write_version",
    "gc",
    "verify_index",
    "seal_version",
    "SEAL_FILE",
    "SealStatus",
    "seal_status",
    "write_sealed_manifest",
]
