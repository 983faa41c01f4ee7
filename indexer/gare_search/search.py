"""The search's entry points (SPEC §4-5): :func:`search` and :func:`search_batch`, their options and results.

Layer: ``gare`` core (model, psi fold) <- ``gare_index`` (the format: :class:`gare_index.store.IndexVersion`)
<- ``gare_search`` (this package) <- the service (``gare_serve``) and the builder's evaluation tools
(``gare_build.compare``). A request goes route -> :func:`search_batch` -> query encoding
(:mod:`gare_search.query`) -> stage 1 (:mod:`gare_search.stage1`, the index version's ANN, plain or with the
NCL fold) -> the psi rerank (:mod:`gare_search.rerank`, the fold) -> biases and :func:`rank` (here).

For each query text: ``t = encode_text`` -> unit ``t/|t|`` -> ANN top-K by ``cos(t, v̄_j)`` -> psi score
``s_tj`` for those K candidates -> ``+ b_j`` (NCL bias) -> sort -> top k.

Modes: ``rerank=False`` ranks the K candidates by the dual-tower cosine (ANN-only), ``ncl=False`` leaves
the biases out. :func:`search` is the offline entry point; the service calls the same stages on
micro-batches (:func:`search_batch`), so its answers equal the offline ones.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from gare.model_protocols import SearchModel
from gare_index.filters import Filter
from gare_index.version_protocol import SearchVersion
from gare_search.filtered import FILTER_EXACT_BELOW, FilterPlan
from gare_search.query import encode_queries, sync, unit_rows
from gare_search.rerank import DEFAULT_RERANK, RerankSettings, rerank_shortlists
from gare_search.stage1 import shortlists

DEFAULT_CANDIDATES = 256  # K, the stage-1 shortlist, when nobody says (service, compare, SearchOptions)
# The default for `ncl` follows the evidence: on only if + psi + NCL(served) >= + psi in t2v R@1 and
# R@5 on both benchmark corpora; tests/test_evidence.py checks this constant against the measured results.
NCL_DEFAULT = False
NCL_DEFAULT_REASON = ("NCL biases are off by default: adding them to the psi score did not keep t2v R@1 and R@5 at "
                      "least as high as psi alone on every benchmark corpus; an index built with validation captions "
                      "(gare-index build --ncl-val) decides for itself.")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SearchOptions:
    """One query's search options (validated at construction)."""

    k: int = 10
    candidates: int = DEFAULT_CANDIDATES  # K: ANN shortlist size (>= k)
    rerank: bool = True  # psi stage; False = dual-tower cosine only
    ncl: bool = NCL_DEFAULT  # add the NCL video biases (default: NCL_DEFAULT, the evidence)
    ncl_stage1: bool = False  # choose the candidates by cos + b (the index's folded ANN, --ncl-stage1)
    # only videos that pass this filter (compiled against the index's fields: version.compile_filter); None: all
    filter: Filter | None = None
    # a filter passing at most this fraction of the gallery is searched exactly (gare_search.filtered)
    filter_exact_below: float = FILTER_EXACT_BELOW

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k}")
        if self.candidates < self.k:
            raise ValueError(f"candidates (K={self.candidates}) must be >= k ({self.k})")
        if not 0.0 <= self.filter_exact_below <= 1.0:
            raise ValueError(f"filter_exact_below must be in [0, 1], got {self.filter_exact_below}")


@dataclass
class Hit:
    """One ranked video of a query's result."""

    id: int
    score: float  # what the ranking used: (psi score or cosine) + bias when ncl
    ann_score: float  # dual-tower cosine from the ANN stage
    psi_score: float | None  # s_tj, None when rerank is off
    bias: float  # b_j (reported even when ncl is off; then not added)


@dataclass
class QueryResult:
    """One query's hits and the stage timings of the batch it was searched in."""

    hits: list[Hit]
    timings: dict[str, float] = field(default_factory=dict)  # seconds: encode, ann, rerank, total
    cached: bool = False  # the query embedding came from the service's cache (encode 0 for this query)
    plan: FilterPlan | None = None  # how stage 1 ran under the query's filter (None: no filter)


def rank(
    ann_scores: np.ndarray,
    ids: np.ndarray,
    psi: np.ndarray | None,
    biases: np.ndarray,
    opts: SearchOptions,
) -> list[Hit]:
    """Final scores for one query's valid candidates; sorted by score desc, then id asc; top k."""
    base = ann_scores if psi is None else psi
    final = base + biases if opts.ncl else base.copy()
    order = np.lexsort((ids, -final))[: opts.k]
    return [
        Hit(
            id=int(ids[j]),
            score=float(final[j]),
            ann_score=float(ann_scores[j]),
            psi_score=None if psi is None else float(psi[j]),
            bias=float(biases[j]),
        )
        for j in order
    ]


def search_batch(
    model: SearchModel,
    version: SearchVersion,
    texts: Sequence[str],
    options: SearchOptions | Sequence[SearchOptions] = SearchOptions(),
    *,
    precision: str = "fp32",
    on_units: Callable[[np.ndarray], object] | None = None,
    encoder: Callable[[list[str]], torch.Tensor] | None = None,
    tower: Callable[[torch.Tensor], torch.Tensor] | None = None,
    rerank_settings: RerankSettings = DEFAULT_RERANK,
) -> list[QueryResult]:
    """Search many queries with one text-encoder pass, one ANN call per distinct K and one rerank pass.

    Every result carries the batch's stage timings (seconds). `on_units`, when given, receives the unit
    query embeddings (n_q, d) as a float32 array (the service's adaptive query bank). `tower` chooses the
    text tower: a gare.text_quant encoder (``build_text_encoder(model, kind)``, what the service's
    `text_encoder` setting builds), None = the model's own at `precision`. `encoder`, when given, replaces
    ``encode_queries(model, texts, precision, tower=tower)``: texts -> t (n_q, d) float32 on the model's
    device (the service's query-embedding cache in front of that same call). `rerank_settings`: where the psi
    rerank runs and its threads (the service passes its own; the default runs it where the model is).
    """
    n_q = len(texts)
    opts = [options] * n_q if isinstance(options, SearchOptions) else list(options)
    if len(opts) != n_q:
        raise ValueError(f"{n_q} queries but {len(opts)} option sets")
    if n_q == 0:
        return []
    dev = model.device
    t0 = time.perf_counter()
    t = encoder(list(texts)) if encoder is not None else encode_queries(model, texts, precision, tower=tower)
    t = t.to(dev)
    sync(dev)
    t1 = time.perf_counter()
    units = unit_rows(t)
    if on_units is not None:
        on_units(units.copy())

    plans: list[FilterPlan | None] = [None] * n_q
    ann_s, ann_i = shortlists(version, units, opts, plans)
    t2 = time.perf_counter()
    psi = rerank_shortlists(model, version, t, ann_i, opts, rerank_settings)
    sync(dev)
    t3 = time.perf_counter()

    biases = np.asarray(version.biases, dtype=np.float32)
    results = []
    for i, o in enumerate(opts):
        b = biases[version.rows(ann_i[i])] if ann_i[i].size else np.zeros(0, np.float32)
        hits = rank(ann_s[i], ann_i[i], psi[i], b, o)
        results.append(QueryResult(hits, {}))
    t4 = time.perf_counter()
    timings = {"encode": t1 - t0, "ann": t2 - t1, "rerank": t3 - t2, "rank": t4 - t3, "total": t4 - t0}
    for r, plan in zip(results, plans, strict=True):
        r.timings = dict(timings)
        if plan is not None:
            r.plan = plan
            r.timings["filter"] = plan.filter_s
    return results


def search(
    model: SearchModel,
    version: SearchVersion,
    query: str,
    options: SearchOptions = SearchOptions(),
    *,
    precision: str = "fp32",
    tower: Callable[[torch.Tensor], torch.Tensor] | None = None,
    rerank_settings: RerankSettings = DEFAULT_RERANK,
) -> QueryResult:
    """The offline search of one query (what the API must return for the same index, options and text tower:
    `tower` as in :func:`search_batch`, e.g. ``build_text_encoder(model, "int8")`` for a service on int8)."""
    return search_batch(model, version, [query], options, precision=precision, tower=tower,
                        rerank_settings=rerank_settings)[0]
