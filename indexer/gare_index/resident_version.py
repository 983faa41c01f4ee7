"""An index version served from a device-resident copy: :class:`ResidentVersion` (the wrapped version's names,
metadata, ids -> rows and manifest; stage 1 and the rerank's rows from :class:`gare_index.resident.ResidentIndex`)
and the measured choice of its stage 1 (:class:`Stage1Decision`).

Stage 1 is either the exact search on the device (one matrix product + top-k, recall 1.0) or the version's own
ANN (faiss: the GPU copy when :mod:`gare_index.ann_gpu` placed it there, else the CPU index). :func:`load_resident`
times both on noisy copies of gallery rows taken from all over the gallery, one query per call at the K the
service asks, and keeps the exact search when its p50 is at most the ANN's (exact wins where it is as fast);
:func:`decide` is that rule on the two numbers, and a caller may force either method.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gare.model_protocols import PsiModel
from gare_index import psi_consts
from gare_index.frame_quant import QuantFrames
from gare_index.resident import WORKSPACE_QUERIES, ResidentIndex, check_fits, device_list, estimate
from gare_index.version_protocol import ManifestView, SearchVersion

log = logging.getLogger(__name__)

__all__ = ["STAGE1_METHODS", "Stage1Decision", "decide", "measure_stage1", "ResidentVersion", "load_resident"]

STAGE1_METHODS = ("exact", "ann")
MEASURE_SAMPLE = 64  # queries timed per method
_WARM = 3  # untimed calls per method first (CUDA context, cuBLAS handles, faiss GPU buffers)


@dataclass(frozen=True)
class Stage1Decision:
    """Which stage 1 a resident version runs and why (the service logs / exports :meth:`as_dict`)."""

    method: str  # "exact" (torch product + top-k on the devices) or "ann" (the version's faiss index)
    exact_p50_ms: float | None  # p50 of one exact query (None: not measured, the method was forced)
    ann_p50_ms: float | None  # p50 of one ANN query
    sample: int  # queries timed per method
    k: int  # candidates per query timed
    devices: tuple[str, ...]  # where the exact search and the rerank's rows live
    ann: str  # the ANN timed: its index and where faiss searches it
    reason: str

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["devices"] = list(self.devices)
        return d


def decide(exact_p50_ms: float | None, ann_p50_ms: float | None, *, sample: int, k: int, devices: Sequence[str],
           ann: str, forced: str | None = None) -> Stage1Decision:
    """The rule: `forced` ("exact" / "ann") when given; else exact when its p50 is at most the ANN's (exact has
    recall 1.0, so it wins ties), else the ANN."""
    if forced is not None and forced not in STAGE1_METHODS:
        raise ValueError(f"stage-1 method must be one of {STAGE1_METHODS} or None, got {forced!r}")
    common = dict(exact_p50_ms=exact_p50_ms, ann_p50_ms=ann_p50_ms, sample=sample, k=k, devices=tuple(devices), ann=ann)
    if forced is not None:
        return Stage1Decision(method=forced, reason=f"forced by the caller ({forced})", **common)
    if exact_p50_ms is None or ann_p50_ms is None:
        raise ValueError(f"both p50s are needed to choose (exact {exact_p50_ms}, ann {ann_p50_ms})")
    if exact_p50_ms <= ann_p50_ms:
        return Stage1Decision(method="exact", reason=(
            f"exact p50 {exact_p50_ms:.3f} ms <= ANN p50 {ann_p50_ms:.3f} ms at K={k} over {sample} queries: "
            "exact (recall 1.0) is as fast"), **common)
    return Stage1Decision(method="ann", reason=(
        f"ANN p50 {ann_p50_ms:.3f} ms < exact p50 {exact_p50_ms:.3f} ms at K={k} over {sample} queries"), **common)


def ann_description(version: SearchVersion) -> str:
    """The version's ANN as timed: its index and where faiss searches it (from its GPU plan)."""
    ann = getattr(version, "ann", None)
    plan = getattr(ann, "gpu_plan", None)
    if plan is None:
        return f"{type(ann).__name__} of {version.name}"
    return f"{plan.index} on the {'GPU' if plan.on_gpu else 'CPU'} ({plan.reason})"


def sample_queries(version: SearchVersion, sample: int, *, seed: int = 0, noise: float = 0.5) -> np.ndarray:
    """`sample` unit queries (sample, d) float32: gallery rows spread evenly over the whole gallery (every part of
    it, not one cluster) plus Gaussian noise of norm ~`noise`, renormalised (a caption is near, not on, its video)."""
    n = version.n
    rows = np.unique(np.linspace(0, max(n - 1, 0), num=min(sample, n)).round().astype(np.int64))
    vec = np.asarray(getattr(version, "stage1_units", version.units)[rows], dtype=np.float32)
    rng = np.random.default_rng(seed)
    q = vec + rng.standard_normal(vec.shape).astype(np.float32) * (noise / np.sqrt(vec.shape[1]))
    return (q / np.maximum(np.linalg.norm(q, axis=1, keepdims=True), 1e-12)).astype(np.float32)


def _p50_ms(fn: Any, queries: np.ndarray, k: int) -> float:
    for i in range(min(_WARM, len(queries))):
        fn(queries[i : i + 1], k)
    times = []
    for i in range(len(queries)):
        t0 = time.perf_counter()
        fn(queries[i : i + 1], k)  # returns numpy: the device's work is finished when it returns
        times.append(time.perf_counter() - t0)
    return float(np.percentile(np.asarray(times), 50) * 1000.0)


def measure_stage1(version: SearchVersion, resident: ResidentIndex, k: int, *, sample: int = MEASURE_SAMPLE,
                   seed: int = 0) -> tuple[float, float, int]:
    """(exact p50 ms, ANN p50 ms, queries timed): each method searched one query per call, K = k, the whole call
    as the search makes it (numpy in, numpy out)."""
    q = sample_queries(version, sample, seed=seed)
    exact = _p50_ms(resident.search, q, k)
    ann = _p50_ms(version.search, q, k)
    return exact, ann, len(q)


class ResidentVersion:
    """An index version whose stage 1 (the chosen method) and psi rerank read a device-resident copy.

    Implements :class:`gare_index.version_protocol.SearchVersion`: names, ids -> rows, biases, the manifest and
    everything else (metadata, path_of, ann, ...) are the wrapped version's; :meth:`search` runs
    :attr:`decision`'s stage 1; :func:`gare_index.psi_candidates.candidate_constants` gathers a rerank's
    candidates from :attr:`resident` (index_select on the devices) instead of the host arrays."""

    def __init__(self, version: SearchVersion, resident: ResidentIndex, decision: Stage1Decision) -> None:
        self._version = version
        self.resident = resident
        self.decision = decision

    @property
    def wrapped(self) -> SearchVersion:
        """The version this one serves from the device (its arrays stay memory-mapped on the host)."""
        return self._version

    # --- the SearchVersion protocol, delegated
    @property
    def name(self) -> str:
        return self._version.name

    @property
    def root(self) -> Path:
        return self._version.root

    @property
    def n(self) -> int:
        return self._version.n

    @property
    def max_frames(self) -> int:
        return self._version.max_frames

    @property
    def manifest(self) -> ManifestView:
        return self._version.manifest

    @property
    def frames(self) -> np.ndarray | QuantFrames:
        return self._version.frames

    @property
    def frame_scales(self) -> np.ndarray | None:
        return self._version.frame_scales

    @property
    def masks(self) -> np.ndarray:
        return self._version.masks

    @property
    def units(self) -> np.ndarray:
        return self._version.units

    @property
    def norms(self) -> np.ndarray:
        return self._version.norms

    @property
    def psi_consts(self) -> np.ndarray | None:
        return self._version.psi_consts

    @property
    def ids(self) -> np.ndarray:
        return self._version.ids

    @property
    def biases(self) -> np.ndarray:
        return self._version.biases

    def rows(self, ids: np.ndarray, *, missing: str = "raise") -> np.ndarray:
        return self._version.rows(ids, missing=missing)

    def search(self, queries: np.ndarray, k: int, *, ncl_stage1: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Stage 1 by :attr:`decision`: (cosines (q, k) float32, ids (q, k) int64), missing results id -1; with
        `ncl_stage1` the candidates are the top k by cos + b (only where the wrapped version offers that stage 1,
        so that the answers and refusals stay the wrapped version's)."""
        if self.decision.method != "exact":
            return self._version.search(queries, k, ncl_stage1=ncl_stage1)
        check = getattr(self._version, "check_stage1", None)
        if ncl_stage1 and check is not None:
            check(ncl_stage1=True)
        return self.resident.search(queries, k, ncl_stage1=ncl_stage1)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_version":
            raise AttributeError(name)
        return getattr(self._version, name)

    def close(self) -> None:
        """Free the device copy and close the wrapped version."""
        self.resident.release()
        close = getattr(self._version, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> ResidentVersion:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def load_resident(version: SearchVersion, model: PsiModel, *, k: int,
                  devices: Sequence[str | torch.device] | None = None, cap_bytes: int | None = None,
                  method: str | None = None, sample: int = MEASURE_SAMPLE, seed: int = 0,
                  workspace_queries: int = WORKSPACE_QUERIES) -> ResidentVersion:
    """`version` copied onto `devices` (default: every CUDA device, else the CPU), the gallery split in
    contiguous row ranges across them, with its stage 1 chosen by measurement at K = `k` (the candidates the
    service asks) unless `method` ("exact" / "ann") forces it.

    The psi constants copied are the ones the rerank serves for `model` (the stored ones when valid, else folded
    in memory once: :func:`gare_index.psi_consts.served`). Raises :class:`gare_index.resident.ResidentTooLarge`
    before copying anything when a device's share exceeds `cap_bytes` (per device; None = no cap) or its free
    memory: the caller then serves `version` itself (the CPU path)."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if method is not None and method not in STAGE1_METHODS:
        raise ValueError(f"stage-1 method must be one of {STAGE1_METHODS} or None, got {method!r}")
    fold = psi_consts.fold_of(model)
    with torch.inference_mode():
        consts = psi_consts.served(model, version)
    est = estimate(version, device_list(devices), consts, workspace_queries=workspace_queries)
    check_fits(est, cap_bytes)
    if torch.get_float32_matmul_precision() != "highest" and any(d.startswith("cuda") for d in est.devices):
        log.warning("torch float32 matmul precision is %r: the exact stage 1 on CUDA may use TF32 (scores to ~1e-3, "
                    "not float32)", torch.get_float32_matmul_precision())
    resident = ResidentIndex.copy(version, consts, fold.fingerprint, est)
    ann = ann_description(version)
    if method is not None:
        decision = decide(None, None, sample=0, k=k, devices=est.devices, ann=ann, forced=method)
    elif version.n == 0:
        decision = Stage1Decision("exact", None, None, 0, k, est.devices, ann, "empty gallery: nothing to time")
    else:
        exact_ms, ann_ms, m = measure_stage1(version, resident, k, sample=sample, seed=seed)
        decision = decide(exact_ms, ann_ms, sample=m, k=k, devices=est.devices, ann=ann)
    log.info("index version %s stage 1: %s (%s)", version.name, decision.method, decision.reason)
    return ResidentVersion(version, resident, decision)
