"""What the psi constants and the search read of an opened index version, as Protocols.

:class:`gare_index.store.index_version.IndexVersion` is the one implementation; a proxy that wraps it (the service's
recall watch) or a test's stand-in provides the same members. The Protocols live here, beside
:mod:`gare_index.psi_consts`, because :mod:`gare_index.store` imports that module: naming ``IndexVersion`` there
would close an import cycle.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from gare_index.frame_quant import QuantFrames

if TYPE_CHECKING:  # gare_index.store imports this module (through psi_consts): names only, no import at run time
    from gare_index.filter_cache import FilterRows
    from gare_index.filters import Filter


class CheckpointView(Protocol):
    """The manifest's checkpoint entry (``gare_index.store.manifest.CheckpointRef``): where the file was."""

    @property
    def path(self) -> str | None: ...


class ManifestView(Protocol):
    """The manifest entries the psi constants are checked against (``gare_index.store.manifest.IndexManifest``)."""

    @property
    def psi_fold(self) -> Mapping[str, Any] | None: ...

    @property
    def checkpoint_sha256(self) -> str | None: ...

    @property
    def checkpoint(self) -> CheckpointView | None: ...


class PsiVersion(Protocol):
    """An index version's rows as the psi constants and the rerank read them: ids -> rows, the frames (float16
    memmap (n, f, d), or int8 :class:`QuantFrames` with per-frame scales), masks (n, f), units (n, d), norms
    (n,), the stored constants (n, 10f + 5f² + 2) or None, and the manifest they are checked against."""

    @property
    def name(self) -> str: ...

    @property
    def root(self) -> Path: ...

    @property
    def n(self) -> int: ...

    @property
    def max_frames(self) -> int: ...

    @property
    def manifest(self) -> ManifestView: ...

    @property
    def frames(self) -> np.ndarray | QuantFrames: ...

    @property
    def frame_scales(self) -> np.ndarray | None: ...

    @property
    def masks(self) -> np.ndarray: ...

    @property
    def units(self) -> np.ndarray: ...

    @property
    def norms(self) -> np.ndarray: ...

    @property
    def psi_consts(self) -> np.ndarray | None: ...

    def rows(self, ids: np.ndarray, *, missing: str = "raise") -> np.ndarray: ...


class SearchVersion(PsiVersion, Protocol):
    """An index version a query searches: the rows above, stage 1 (:meth:`search`) and the NCL biases (n,)."""

    @property
    def ids(self) -> np.ndarray: ...

    @property
    def biases(self) -> np.ndarray: ...

    def search(self, queries: np.ndarray, k: int, *, ncl_stage1: bool = False) -> tuple[np.ndarray, np.ndarray]: ...

    def filter_rows(self, f: Filter) -> tuple[FilterRows, bool]: ...

    def id_bitmap(self, rows: np.ndarray) -> np.ndarray: ...

    def scan_fraction(self, *, ncl_stage1: bool = False) -> float | None: ...

    def search_filtered(self, queries: np.ndarray, k: int, rows: np.ndarray, *, ncl_stage1: bool = False,
                        widen: int = 1, bits: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, bool]: ...
