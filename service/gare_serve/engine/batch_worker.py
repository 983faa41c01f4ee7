"""The micro-batch worker: one thread runs the queued text queries of a batch through the search, version by version.

:class:`Job` is one queued query (the version it started on, its text, its options); :func:`process_jobs` is the
function the service's :class:`gare_serve.engine.batcher.MicroBatcher` calls with a batch. Jobs on the same index version
share one ``gare_search.search.search_batch`` call; the query embeddings come from the query cache when it has
them (``gare_serve.engine.query_cache``), else from the search's own encoder (``gare_search.text_encoder``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gare_search import search as S

log = logging.getLogger(__name__)

__all__ = ["Job", "process_jobs"]


@dataclass
class Job:
    version: Any
    query: str
    options: S.SearchOptions


def process_jobs(state: Any, jobs: Sequence[Job]) -> list[S.QueryResult]:
    """The results of ``jobs``, in order. ``state``: the service's ``gare_serve.engine.state.ServiceState`` (its model,
    query encoder, query cache, query bank and recall watch)."""
    out: list[S.QueryResult | None] = [None] * len(jobs)
    groups: dict[int, list[int]] = {}
    for i, j in enumerate(jobs):
        groups.setdefault(id(j.version), []).append(i)
    cache = state.query_cache
    encoder = state.encoder
    for members in groups.values():
        version = jobs[members[0]].version
        flags: list[bool] = []

        def encode(texts: list[str], flags: list[bool] = flags) -> torch.Tensor:
            # distinct misses go through the tower once; hits skip it (key: checkpoint sha + variant + text)
            if cache is None or not cache.enabled:
                flags.extend([False] * len(texts))
                return encoder.encode(texts)
            t, hit = cache.encode(texts, state.checkpoint_sha or "", encoder.encode, variant=encoder.variant)
            flags.extend(hit)
            return t

        watch = state.recall_watch  # samples this batch's stage-1 lists for an exact re-run (gare_serve.engine.recall_watch)
        res = state.search_batch(  # gare_search.search.search_batch (the sharded one in the Ray ingress)
            state.model,
            version if watch is None else watch.wrap(version),
            [jobs[i].query for i in members],
            [jobs[i].options for i in members],
            precision=encoder.precision,
            on_units=state.query_bank.push if state.query_bank is not None else None,
            encoder=encode,
        )
        for i, r, hit in zip(members, res, flags, strict=True):
            if hit:  # this query's embedding came from the cache: it cost no encoder time
                r.timings = {**r.timings, "encode": 0.0}
                r.cached = True
            out[i] = r
    return out  # type: ignore[return-value]
