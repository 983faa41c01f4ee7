"""Stage 2 of the search: psi scores of the stage-1 candidates, by the fold (the one served implementation).

psi is folded exactly into per-video constants (stored in the index, :mod:`gare_index.psi_consts`) and
per-query vectors (:mod:`gare.psi_fold`): ~3f + 1 dot products per pair plus O(f²) work, equal to
``model.score`` to float32 rounding (the tests check it against the model and a fused reference to 1e-5).
A rerank asks the index once for its candidates' constants (:func:`gare_index.psi_candidates.candidate_constants`),
folds the queries (cached per query embedding) and calls the pair stage once: on the CPU the compiled kernel
(:mod:`gare.psi_fold_cpu`, numba) reads each candidate's rows straight from the memory-mapped arrays; elsewhere
(CUDA) the candidates of a whole batch are read once (unique rows) and share their constants in torch ops.

Where the rerank runs and how many threads it takes are the caller's :class:`RerankSettings`, passed down with
each call (the service builds one from its settings); nothing here is a process-wide switch.

An index version without valid constants (written before them, or folded for other psi weights) is served
with constants folded in memory when it is first used (:func:`prepare`, at load in the service), with one
WARNING naming ``gare-index upgrade`` (:func:`gare_index.psi_consts.served`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Protocol

import numpy as np
import torch
from tqdm import tqdm

from gare import psi_fold as pf
from gare import psi_fold_cpu, psi_fold_cpu_queries
from gare.model_protocols import PsiModel
from gare.psi_fold_queries import QueryFoldCache, fold_arrays, fold_queries
from gare_index import psi_consts
from gare_index.psi_candidates import candidate_constants, kernel_reads, unpad
from gare_index.resident_version import ResidentVersion
from gare_index.version_protocol import PsiVersion

log = logging.getLogger(__name__)

__all__ = ["RERANK_DEVICES", "RerankSettings", "DEFAULT_RERANK", "QUERY_FOLDS", "fold_usable", "prepare", "warm_up",
           "kernel_reads", "psi_scores", "exhaustive_psi", "rerank_shortlists"]

# The query side of the fold per query embedding: a query seen again (the service's query cache returns the
# same t) skips its (d, 2d + 3) product. 4,096 queries x 6 KB at d = 512: ~25 MB at most.
QUERY_FOLDS = QueryFoldCache(4096)

# Where the psi rerank runs when the model is on a GPU: "model" (there: the candidates' rows are gathered from the
# memory-mapped arrays and copied over) or "cpu" (the compiled CPU kernel reads them in place; only the query
# vectors cross). bench/gpu_bench.py measures both (bench/results/gpu_bench.md). On a CPU model both are the CPU
# kernel.
RERANK_DEVICES = ("model", "cpu")


@dataclass(frozen=True)
class RerankSettings:
    """How one search runs its psi rerank: `device` (one of RERANK_DEVICES: "model" = where the model is, "cpu" =
    the compiled CPU kernel over the memory-mapped index) and `threads` (how many threads one rerank may use;
    None = the torch intra-op threads of this process: gare-serve gives each worker usable cores // workers, so
    a worker spreads its rerank only over cores no other worker was given)."""

    device: str = "model"
    threads: int | None = None

    def __post_init__(self) -> None:
        if self.device not in RERANK_DEVICES:
            raise ValueError(f"rerank device must be one of {RERANK_DEVICES}, got {self.device!r}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"rerank threads must be >= 1 (or None), got {self.threads}")

    def thread_count(self) -> int:
        """Threads one rerank may use: `threads` when set, else the torch intra-op threads."""
        return max(1, self.threads or torch.get_num_threads())


DEFAULT_RERANK = RerankSettings()


class RerankChoice(Protocol):
    """A query's options as the rerank reads them (``gare_search.search.SearchOptions``): rerank on or off."""

    @property
    def rerank(self) -> bool: ...


def fold_usable(model: PsiModel, version: PsiVersion) -> bool:
    """Whether `version` stores psi constants valid for model.psi (else the search folds them in memory)."""
    return psi_consts.fold_status(version, psi_consts.fold_of(model)) is None


def prepare(model: PsiModel, version: PsiVersion) -> None:
    """Get `version` ready for the rerank: fold its constants in memory now (one WARNING) when it stores no
    valid ones, so that no request pays for it. A resident version whose device copy holds this psi's
    constants needs nothing (its rerank reads the copy); otherwise its wrapped version is prepared."""
    if isinstance(version, ResidentVersion):
        if version.resident.fingerprint == psi_consts.fold_of(model).fingerprint:
            return
        version = version.wrapped
    psi_consts.served(model, version)


def warm_up(device: torch.device | str, settings: RerankSettings = DEFAULT_RERANK) -> None:
    """Compile the CPU kernels of the rerank and its query fold (seconds, once per process) when a rerank with
    `settings` for a model on `device` will use them, so that no request pays for it."""
    if (torch.device(device).type == "cpu" or settings.device == "cpu") and psi_fold_cpu.available():
        psi_fold_cpu.warm_up()
        psi_fold_cpu_queries.warm_up()


def psi_scores(model: PsiModel, version: PsiVersion, t: torch.Tensor, cand_ids: np.ndarray | Sequence[np.ndarray],
               *, settings: RerankSettings = DEFAULT_RERANK) -> list[np.ndarray]:
    """psi scores s_tj for each query's candidates: t (a, d); cand_ids[i] (K_i,) valid ids -> list of (K_i,)."""
    if len(cand_ids) == 1:  # one query (the common request): no offsets, no concatenation
        c = np.asarray(cand_ids[0], dtype=np.int64).reshape(-1)
        if c.size == 0:
            return [np.zeros(0, np.float32)]
        return [_fold_pairs(model, version, t, version.rows(c), [c.size], settings)]
    lists = [np.asarray(c, dtype=np.int64).reshape(-1) for c in cand_ids]
    sizes = [c.size for c in lists]
    offs = np.cumsum([0] + sizes)
    if offs[-1] == 0:
        return [np.zeros(0, np.float32) for _ in lists]
    rows = version.rows(lists[0] if len(lists) == 1 else np.concatenate(lists))
    flat = _fold_pairs(model, version, t, rows, sizes, settings)
    return [flat[a:b] for a, b in zip(offs[:-1], offs[1:], strict=True)]


def _row_f32(t: torch.Tensor) -> np.ndarray:
    """t (1, d) on the CPU -> its row as float32 numpy (d,), a view when t is float32 (one tensor call: with the
    caches cold after stage 1 a torch call costs several times a numpy one, see bench/results/rerank_floor.md)."""
    try:
        row = t.detach().numpy()[0]
    except TypeError:  # bfloat16 and other dtypes numpy lacks
        row = t.detach().to(torch.float32).numpy()[0]
    return row if row.dtype == np.float32 else row.astype(np.float32)


def _fold_pairs(model: PsiModel, version: PsiVersion, t: torch.Tensor, rows: np.ndarray, sizes: list[int],
                settings: RerankSettings) -> np.ndarray:
    """Folded psi for the pairs (query i, rows of its candidates), flat in the callers' order: one call into the
    index for the candidates' constants, the query fold, one call into the pair stage.

    On the CPU the compiled kernel reads each candidate's rows straight from the memory-mapped arrays; one query
    (the common request) goes from t to the scores through numpy arrays only, no tensor op between (on a cold
    cache each costs more than the numpy work it wraps). Elsewhere the batch's candidate rows are read once into
    one VideoConstants that every query shares. Either way K is padded to the batch's largest."""
    if t.device.type != "cpu" and settings.device == "cpu" and psi_fold_cpu.available():
        t = t.detach().to("cpu", torch.float32)  # (a, d): the kernel reads the candidates where they are stored
    c = candidate_constants(model, version, rows, sizes, t.device)
    threads = settings.thread_count()
    if c.kernel is not None and len(sizes) == 1:
        u, sc = QUERY_FOLDS.fold_one(_row_f32(t), c.fold, c.temp)
        fa = fold_arrays(c.fold)
        qa = SimpleNamespace(u=u, sc=sc, wsc=fa.scalars, eps=fa.eps, inv_temp=1.0 / float(c.temp))
        return psi_fold_cpu.scores(qa, c.kernel, c.idx, threads=threads)[0]
    with torch.inference_mode():
        q = QUERY_FOLDS.fold(t, c.fold, c.temp)
        if c.kernel is not None:
            s = psi_fold_cpu.scores(q, c.kernel, c.idx, threads=threads)
        else:
            assert c.videos is not None  # candidate_constants gives one or the other
            s = pf.pair_scores(q, c.videos, torch.from_numpy(c.idx).to(t.device)).cpu().numpy()
    return unpad(s, sizes)


def exhaustive_psi(model: PsiModel, version: PsiVersion, t: torch.Tensor, *, block: int = 8192,
                   progress: bool = False) -> np.ndarray:
    """psi scores of every gallery entry for each query (a, n), block by block (coverage, benchmarks, compare).

    The index's stored constants when valid, else the fold computed block by block (one log line): a whole
    gallery is one large product per block."""
    n = version.n
    out = np.empty((t.shape[0], n), dtype=np.float32)
    dev = t.device
    fold = psi_consts.fold_of(model)
    why = psi_consts.fold_status(version, fold)
    if why is not None:
        log.info("exhaustive psi: %s; folding the constants block by block instead", why)
    q = fold_queries(t, fold, model.cfg.temp)
    starts = tqdm(range(0, n, block), desc="exhaustive psi (fold)", unit="block", disable=not progress)
    with torch.inference_mode():
        for s0 in starts:
            v = psi_consts.block(version, s0, min(n, s0 + block), fold, dev, stored=why is None,
                                 reference_padding=psi_consts.reference_padding(model))
            out[:, s0 : s0 + v.n] = pf.exhaustive(q, v, device=dev).numpy()
    return out


def rerank_shortlists(model: PsiModel, version: PsiVersion, t: torch.Tensor, ids: Sequence[np.ndarray],
                      opts: Sequence[RerankChoice], settings: RerankSettings = DEFAULT_RERANK) -> list[np.ndarray | None]:
    """psi scores of every query's shortlist in one pass, None for a query whose options turn the rerank off:
    t (a, d) float32, ids[i] query i's candidate ids."""
    psi: list[np.ndarray | None] = [None] * len(opts)
    need = [i for i, o in enumerate(opts) if o.rerank]
    if need:
        tn = t if len(need) == len(opts) else t[need]  # every query reranked (the common case): no gather
        for i, s in zip(need, psi_scores(model, version, tn, [ids[i] for i in need], settings=settings), strict=True):
            psi[i] = s
    return psi
