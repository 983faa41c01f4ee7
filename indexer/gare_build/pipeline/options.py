"""The options of a build/add run and the run report every `gare-index` command writes (INDEX/report.json)."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gare.model import resolve_device
from gare_build.discover import Clip
from gare_build.tuning.version_tuning import Stage1Options
from gare_index.ann_params import INDEX_TYPES
from gare_index.store import REPORT_FILE, atomic_write_text

BUILD_LOCK = ".build.lock"
EXIT_OK, EXIT_FAILED, EXIT_SKIPPED = 0, 1, 3
PRECISIONS = ("fp32", "bf16", "fp16")


def auto_decode_workers(device: str) -> int:
    """Decode worker processes for ``--workers auto``: with the encoder on a GPU, decoding is the build's CPU work,
    so every usable core but one (the loop that feeds the GPU and writes the work cache) decodes; on the CPU the
    encoder needs the cores itself, so 2 (what the build always used there)."""
    try:
        on_gpu = resolve_device(device).type == "cuda"
    except (RuntimeError, ValueError):  # an unusable --device fails later with its own message
        on_gpu = False
    if not on_gpu:
        return 2
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    return max(2, cores - 1)


def progress_enabled(opt: bool | None) -> bool:
    """--progress / --no-progress, or (not given) a progress bar when stderr is a terminal."""
    return sys.stderr.isatty() if opt is None else bool(opt)


@dataclass
class BuildOptions:
    index_type: str | None = None  # None: "auto" for build, the index's own choice for add/remove
    nlist: int | None = None
    nprobe: int | None = None
    hnsw_m: int | None = None
    ef_search: int | None = None
    ef_construction: int | None = None
    pq_m: int | None = None
    rescore: int | None = None
    rebuild_ann: bool = False
    segment: float | None = None
    overlap: float = 0.0
    batch_size: int = 16
    workers: int = 2  # decode worker processes (local engine)
    device: str = "auto"
    precision: str | None = None  # None: fp32 for build, the index's precision for add
    engine: str = "local"
    scheduler: str | None = None
    dask_workers: int = 2
    shard_size: int = 64
    store_kv: bool | None = None  # None: off for build, as the index for add
    frames_dtype: str | None = None  # "float16" | "int8" (gare_index.frame_quant); None: float16 for build, as the index for add
    keep: int = 3
    n_iters: int = 4
    progress: bool | None = None  # None: when stderr is a terminal
    decode_timeout: float = 300.0
    scan_threads: int = 4
    # post-processing (docs/postprocessing.md); None: off for build, as the index for add
    invgc: bool | None = None  # InvGC w/ LocalAdj on the stage-1 vectors
    invgc_val: Any = None  # validation data for the r search: manifest, synth folder, data spec; None: the checkpoint's
    invgc_r_g: float | None = None  # given r values skip the search
    invgc_r_q: float | None = None
    invgc_k: float = 1.0  # LocalAdj: top k% neighbours
    invgc_grid: tuple[float, ...] | None = None  # None: gare.invgc.DEFAULT_GRID
    ncl_stage1: bool | None = None  # also write ann_ncl.faiss (NCL biases folded into stage 1)
    ncl_c: float = 1.0  # fold constant: index [v ; b / c], query [t ; c]
    # NCL biases: fitted to the served psi score (sparse: exact psi on each queue query's top bias_k) or to the
    # dual-tower cosine; None: "served" for build, as the index for add
    bias_score: str | None = None
    bias_k: int = 256
    # the queue the biases are fitted to (gare_build.pipeline.biases.bias_queue): fresh | stale; None: fresh when the
    # training captions can be read (bias_captions, else the checkpoint's data), else stale; add: as the index
    bias_queue: str | None = None
    bias_captions: str | None = None
    # validation captions (manifest or synth folder) on which psi vs psi + biases decides the index's NCL default
    # (biases.default); None: no decision (add: the previous version's captions, when it had a decision)
    ncl_val: str | None = None
    # with ncl_val: gamma is chosen among these multiples of the checkpoint's on half of the captions
    # (gare_build.pipeline.biases.choose_gamma); (1.0,) keeps the checkpoint's gamma
    ncl_gammas: tuple[float, ...] | None = None  # None: the previous decision's (add), else GAMMA_FACTORS
    # stage-1 tuning (gare_build.tuning.version_tuning): recall target, latency budget, psi coverage -> default K
    stage1: Stage1Options = field(default_factory=Stage1Options)
    tune_captions: Sequence[str] | None = None  # caption texts for the sample queries (--tune-captions)
    # the clips of this run, already discovered and scanned by the caller (the sharded builder scans once and
    # gives each shard its part, gare_build.shard_build); None: discover and scan --videos
    clips: Sequence[Clip] | None = None
    # True: no NCL fit here: the version's biases are zeros recorded as "deferred", fitted afterwards by the caller
    # over a larger gallery (gare_build.shard_build fits them once over every shard's videos)
    defer_biases: bool = False
    # the manifest's own fields, declared (--fields name:type,...); undeclared columns are inferred (build only)
    fields: Mapping[str, str] | None = None

    def validate(self) -> None:
        if self.index_type not in (None, "auto", *INDEX_TYPES):
            raise ValueError(f"--index-type must be auto or one of {INDEX_TYPES}, got {self.index_type!r}")
        if self.precision not in (None, *PRECISIONS):
            raise ValueError(f"--precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.engine not in ("local", "dask"):
            raise ValueError(f"--engine must be local or dask, got {self.engine!r}")
        if self.segment is not None and not (self.segment > 0):
            raise ValueError(f"--segment must be > 0 seconds, got {self.segment}")
        if self.overlap < 0 or (self.segment and self.overlap >= self.segment):
            raise ValueError(f"--overlap must be >= 0 and < --segment, got {self.overlap}")
        if self.overlap and not self.segment:
            raise ValueError("--overlap needs --segment")
        for name in ("batch_size", "shard_size", "keep", "n_iters", "dask_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.workers < 0:
            raise ValueError(f"--workers must be >= 0, got {self.workers}")
        if (self.invgc_r_g is None) != (self.invgc_r_q is None):
            raise ValueError("--invgc-r-g and --invgc-r-q go together (or neither: they are chosen on validation data)")
        for name in ("invgc_r_g", "invgc_r_q"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v >= 0):
                raise ValueError(f"--{name.replace('_', '-')} must be a finite number >= 0, got {v}")
        if not 0 < self.invgc_k <= 100:
            raise ValueError(f"--invgc-k must be in (0, 100] (percent of neighbours), got {self.invgc_k}")
        if self.invgc_grid is not None and (not self.invgc_grid or any(not (math.isfinite(g) and g >= 0) for g in self.invgc_grid)):
            raise ValueError(f"--invgc-grid must be non-negative numbers, got {self.invgc_grid}")
        if self.bias_score not in (None, "served", "dual"):
            raise ValueError(f"--bias-score must be served or dual, got {self.bias_score!r}")
        if self.bias_k < 1:
            raise ValueError(f"--bias-k must be >= 1, got {self.bias_k}")
        if not (math.isfinite(self.ncl_c) and self.ncl_c > 0):
            raise ValueError(f"--ncl-c must be > 0, got {self.ncl_c}")
        self.stage1.validate()
        if self.invgc is False and (self.invgc_r_g is not None or self.invgc_val is not None):
            raise ValueError("--invgc-val / --invgc-r-g / --invgc-r-q need --invgc")


@dataclass
class RunReport:
    command: str
    index: str
    status: str = "ok"
    exit_code: int = EXIT_OK
    version: str | None = None
    previous_version: str | None = None
    started: str = field(default_factory=lambda: _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"))
    elapsed_s: float = 0.0
    n_videos: int = 0  # entries in the new version
    added: int = 0
    updated: int = 0
    unchanged: int = 0
    removed: int = 0
    encoded: int = 0  # clips run through the encoder by this run
    from_cache: int = 0  # clips taken from work/ (an interrupted run)
    from_index: int = 0  # clips whose features came from the previous version
    frames_encoded: int = 0
    encode_s: float = 0.0
    videos_per_s: float = 0.0
    frames_per_s: float = 0.0
    # the local engine's encode loop: where its time went (gare_build.pipeline.encode.EncodeStages.to_dict)
    encode_stages: dict[str, Any] | None = None
    engine: str = "local"
    index_type: str | None = None
    biases: dict[str, Any] = field(default_factory=dict)
    invgc: dict[str, Any] | None = None  # the InvGC values applied to the stage-1 vectors (manifest["invgc"])
    ncl_stage1: bool = False  # whether the version has ann_ncl.faiss
    stage1: dict[str, Any] | None = None  # manifest["stage1"] of the new version (build / add / tune)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    ignored: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def finish(self, t0: float) -> None:
        self.elapsed_s = round(time.time() - t0, 3)
        if self.error:
            self.status, self.exit_code = "failed", EXIT_FAILED
        elif self.skipped:
            self.status, self.exit_code = "done with skipped files", EXIT_SKIPPED
        else:
            self.status, self.exit_code = "ok", EXIT_OK

    def summary(self) -> str:
        if self.error:
            return f"{self.command} failed: {self.error}"
        s = f"{self.command}: {self.n_videos} videos in {self.version or '(no new version)'}"
        if self.command in ("build", "add"):
            s += (
                f" ({self.added} added, {self.updated} updated, {self.unchanged} unchanged; {self.encoded} encoded"
                f" at {self.videos_per_s:.1f} videos/s, {self.frames_per_s:.1f} frames/s; {self.from_cache} from the"
                f" work cache, {self.from_index} reused from the index)"
            )
            st = self.encode_stages
            if st and st.get("batches"):  # which part of the encode loop bounds the rate
                s += (f"; encode loop {st['loop_s']:.1f}s: {st['wait_s']:.1f}s waiting for decoded batches, device"
                      f" {st['device_s']:.1f}s, cache writes {st['write_s']:.1f}s")
                if st.get("decode_frames_per_s_per_worker"):
                    s += f", decode {st['decode_frames_per_s_per_worker']:.0f} frames/s per worker x {st['workers']}"
        if self.removed:
            s += f"; {self.removed} removed"
        s += f"; {len(self.skipped)} skipped"
        if self.skipped:
            s += f" (reasons in {Path(self.index) / REPORT_FILE})"
        return s + f"; {self.elapsed_s:.1f}s"


def write_report(root: Path, report: RunReport) -> None:
    root.mkdir(parents=True, exist_ok=True)
    atomic_write_text(root / REPORT_FILE, json.dumps(report.to_dict(), indent=1, default=str))
