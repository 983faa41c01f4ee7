"""The micro-batch worker: one thread runs the queued text queries of a batch through the search, version by version.

:class:`Job` is one queued query (the version it started on, its text, its options); :class:`BatchSearch` is what
the batch is searched with (the model, its query encoder, the search over one index or over the shards, and the
optional query cache, query bank and recall watch), a snapshot the service takes per batch
(``gare_serve.engine.state.ServiceState.batch_search``); :func:`run_batch` returns the jobs' results in order.

Control flows one way: the worker embeds the texts itself (the query cache in front of the encoder,
``gare_serve.engine.query_cache``, else ``gare_search.text_encoder``), hands the embeddings to one
``gare_search.search.search_batch`` call per index version (that function takes them through its ``encoder``
argument, here a function that returns them), then feeds the query bank with the queries' embeddings t as served
(their |t| included: psi is not scale-invariant, and the tuner and the biases score the bank's rows with psi). The one thing that still reaches back is
the recall watch's view of the version (``gare_serve.engine.recall_watch.RecallWatch.wrap``): the stage-1
candidate lists it samples are not part of a search result, so it observes the version's stage-1 calls.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from gare.model import GARE
from gare_index.store import IndexVersion
from gare_search import search as S
from gare_search.text_encoder import QueryEncoder
from gare_serve.engine.query_cache import QueryCache
from gare_serve.engine.recall_watch import RecallWatch
from gare_serve.engine.traffic_bank import QueryBank

log = logging.getLogger(__name__)

__all__ = ["BatchSearch", "Job", "run_batch"]

# gare_search.search.search_batch's signature, or the sharded one of gare_serve.ray_serve.ingress_state:
# (model, version, texts, options per text, *, encoder=texts -> t (a, d)) -> a result per text
SearchBatchFn = Callable[..., list[S.QueryResult]]


@dataclass(frozen=True)
class Job:
    """One queued text query: the index version its request holds, the text and its resolved options; ``origin``:
    the HTTP worker (pid) that sent it, when a shared engine (``gare_serve.engine.engine_server``) batches queries of
    several workers (0 in process)."""

    version: IndexVersion
    query: str
    options: S.SearchOptions
    origin: int = 0


@dataclass(frozen=True)
class BatchSearch:
    """What a batch is searched with. ``checkpoint_sha`` and the encoder's variant key the query cache; the query
    bank gets every searched query's unit vector; the recall watch samples stage-1 lists."""

    model: GARE
    encoder: QueryEncoder
    search_batch: SearchBatchFn
    checkpoint_sha: str = ""
    query_cache: QueryCache | None = None
    query_bank: QueryBank | None = None
    recall_watch: RecallWatch | None = None

    def embed(self, texts: list[str]) -> tuple[torch.Tensor, list[bool]]:
        """(t (a, d) float32 for ``texts``, per text whether it came from the query cache). Distinct misses go
        through the encoder once; hits skip it (key: checkpoint sha + encoder variant + normalised text)."""
        cache = self.query_cache
        if cache is None or not cache.enabled:
            return self.encoder.encode(texts), [False] * len(texts)
        return cache.encode(texts, self.checkpoint_sha, self.encoder.encode, variant=self.encoder.variant)


def run_batch(search: BatchSearch, jobs: Sequence[Job]) -> list[S.QueryResult]:
    """The results of ``jobs``, in order: one search per index version among them. A result's ``timings``
    include its batch's embedding time under ``encode`` and ``total``, except that a query whose embedding came
    from the query cache reports ``encode`` 0 and ``cached`` True (it cost no encoder time)."""
    out: list[S.QueryResult | None] = [None] * len(jobs)
    groups: dict[int, list[int]] = {}
    for i, j in enumerate(jobs):
        groups.setdefault(id(j.version), []).append(i)
    watch = search.recall_watch
    for members in groups.values():
        version = jobs[members[0]].version
        texts = [jobs[i].query for i in members]
        t0 = time.perf_counter()
        t, from_cache = search.embed(texts)  # (a, d)
        embed_s = time.perf_counter() - t0
        res = search.search_batch(
            search.model,
            version if watch is None else watch.wrap(version),
            texts,
            [jobs[i].options for i in members],
            encoder=lambda _texts, t=t: t,  # the embeddings computed above (the search's way to take them)
        )
        if search.query_bank is not None:
            # (a, d) t as served: psi scored these rows at their |t|, which the tuner and the biases must score at too
            search.query_bank.push(t.detach().to("cpu", torch.float32).numpy())
        for i, r, hit in zip(members, res, from_cache, strict=True):
            timings = {**r.timings, "total": r.timings.get("total", 0.0) + embed_s}
            timings["encode"] = 0.0 if hit else r.timings.get("encode", 0.0) + embed_s
            r.timings = timings
            r.cached = hit
            out[i] = r
    return out  # type: ignore[return-value]
