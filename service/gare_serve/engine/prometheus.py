"""Prometheus metrics, one CollectorRegistry per app (tests create many apps in one process).

- ``gare_http_requests_total{route,method,code}`` and ``gare_http_errors_total{route,code}`` (code >= 400);
- ``gare_http_request_duration_seconds{route}``: latency per route;
- ``gare_search_stage_seconds{stage}``: queue, encode, ann, rerank, total per query;
- ``gare_batch_size``: queries per micro-batch;
- ``gare_index_entries`` and ``gare_index_info{version,index_type,checkpoint}``; ``gare_reloads_total{result}``;
  ``gare_index_checks_total{phase,result}`` (index files re-hashed at open, reload, recheck: ok or mismatch) and
  ``gare_index_check_seconds`` (this worker's last check).

- ``gare_engine_*``: the shared engine (``engine=shared``): per query its queue wait, per batch the HTTP workers
  whose queries it holds and a count of batches mixing workers, requests by kind, process starts; in the workers
  the round trip of each call and the calls it could not answer (``gare_batch_size`` is then the engine's batches).
- ``gare_query_cache_*``: the query embedding cache (gare_serve/engine/query_cache.py).
- ``gare_result_cache_*``: the search result cache (gare_serve/engine/result_cache.py).
- ``gare_stage1_recall*``: stage-1 recall of sampled served queries against an exact search
  (gare_serve/engine/recall_watch.py): per-query histograms ``gare_stage1_recall{stage1}`` (recall@K of the exact
  top-10, K = the manifest's ``recall_at``) and ``gare_stage1_served_recall{stage1}`` (inside the candidates
  actually served); per worker the rolling mean ``gare_stage1_recall_mean`` (NaN until one query is evaluated),
  the queries in it ``gare_stage1_recall_window_queries`` and the version's ``gare_stage1_recall_target`` (NaN:
  not tuned); counters ``gare_stage1_recall_{sampled,dropped}_total``, ``..._evaluated_total{list}``
  (served list or stage 1 re-run at the manifest's K), ``..._skipped_total{reason}``, ``..._cpu_seconds_total``;
  the sustained-low-recall alarm: per worker ``gare_stage1_recall_alarm`` (1 while on) and
  ``gare_stage1_recall_alarms_total`` (docs/retune.md).

Several workers (``gare-serve --workers N``): when ``PROMETHEUS_MULTIPROC_DIR`` is set (the CLI sets and
empties it) every worker writes its series to that directory and ``/metrics`` (on any worker) renders all
of them with prometheus_client's ``MultiProcessCollector``: counters and histograms are summed over the
workers, ``gare_index_entries`` is the largest live value and ``gare_index_info`` is shown per worker
(``pid`` label), so a worker left on an old version after a reload is visible, as is
``gare_worker_requests`` (requests each worker answered). The recall watch's gauges (rolling mean, its size,
the target) are per worker too (``liveall``: each worker samples its own queries; averaging means over
workers of different sizes would be wrong, and a dead worker's series go): compare them by ``pid``, or use
the summed histogram (``rate(gare_stage1_recall_sum) / rate(gare_stage1_recall_count)``) for the fleet.

Routes are labelled by their template (``/v1/videos/{video_id}``), never by the raw path, so the label
set stays bounded; unmatched paths are labelled ``unmatched``.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from gare_serve.engine.query_cache import QueryCacheMetrics
from gare_serve.engine.result_cache import ResultCacheMetrics

_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT"})
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
RECALL_BUCKETS = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)  # per-query recall of a top-10: multiples of 0.1

__all__ = ["Metrics", "MetricsMiddleware", "CONTENT_TYPE_LATEST", "multiprocess_dir", "mark_worker_dead"]


def multiprocess_dir() -> str | None:
    """The prometheus multiprocess directory when this process is one of several workers, else None."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


def mark_worker_dead(pid: int | None = None) -> None:
    """Drop a worker's live gauges (multiprocess mode only; call when the worker exits)."""
    d = multiprocess_dir()
    if d is not None:
        multiprocess.mark_process_dead(os.getpid() if pid is None else pid, d)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "gare_http_requests", "HTTP requests by route, method and status code", ["route", "method", "code"], registry=r
        )
        self.errors = Counter("gare_http_errors", "HTTP responses with status >= 400", ["route", "code"], registry=r)
        self.latency = Histogram(
            "gare_http_request_duration_seconds", "request latency by route", ["route"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.stage = Histogram(
            "gare_search_stage_seconds", "search time per stage and query", ["stage"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.filter_plans = Counter("gare_filter_plans", "filtered searches by stage-1 plan (exact, ann, ann+exact, "
                                    "empty: gare_search.filtered)", ["plan"], registry=r)
        self.batch_size = Histogram("gare_batch_size", "queries per micro-batch", buckets=BATCH_BUCKETS, registry=r)
        self.entries = Gauge(
            "gare_index_entries", "entries in the served index version", registry=r, multiprocess_mode="livemax"
        )
        self.info = Gauge(
            "gare_index_info", "the served index version (value 1)", ["version", "index_type", "checkpoint"], registry=r,
            multiprocess_mode="liveall",
        )
        self._info_labels: tuple[str, str, str] | None = None
        self.reloads = Counter("gare_reloads", "index reloads by result", ["result"], registry=r)
        self.index_checks = Counter(
            "gare_index_checks", "index file checks against the manifest by phase (open, reload, recheck) and result "
            "(ok, mismatch)", ["phase", "result"], registry=r)
        self.index_check_seconds = Gauge("gare_index_check_seconds", "duration of this worker's last index file check",
                                         registry=r, multiprocess_mode="liveall")
        self.thumb_cache = Counter("gare_thumbnail_cache", "thumbnail cache lookups", ["result"], registry=r)
        self.query_cache = QueryCacheMetrics(r)
        self.result_cache = ResultCacheMetrics(r)
        # per worker process (a gauge, so multiprocess mode keeps the pid label instead of summing):
        # shows how the kernel spreads connections over the workers
        self.worker_requests = Gauge(
            "gare_worker_requests", "HTTP requests answered by this worker process", registry=r, multiprocess_mode="liveall"
        )
        # stage-1 recall of sampled served queries vs an exact search (gare_serve/engine/recall_watch.py)
        self.recall = Histogram(
            "gare_stage1_recall", "per sampled query: recall@K of the exact top-10, K = the manifest's recall_at (the "
            "build-time definition)", ["stage1"], buckets=RECALL_BUCKETS, registry=r,
        )
        self.recall_served = Histogram(
            "gare_stage1_served_recall", "per sampled query: share of the exact top-10 inside the candidates served "
            "(the request's K)", ["stage1"], buckets=RECALL_BUCKETS, registry=r,
        )
        self.recall_mean = Gauge(
            "gare_stage1_recall_mean", "this worker's rolling mean of gare_stage1_recall on the served version (NaN: "
            "none evaluated yet)", registry=r, multiprocess_mode="liveall",
        )
        self.recall_window = Gauge(
            "gare_stage1_recall_window_queries", "queries in gare_stage1_recall_mean", registry=r,
            multiprocess_mode="liveall",
        )
        self.recall_target = Gauge(
            "gare_stage1_recall_target", "the served version's stage-1 recall target (manifest stage1.recall_target; "
            "NaN: not tuned)", registry=r, multiprocess_mode="liveall",
        )
        self.recall_sampled = Counter("gare_stage1_recall_sampled", "served queries sampled for an exact re-run", registry=r)
        self.recall_evaluated = Counter(
            "gare_stage1_recall_evaluated", "sampled queries re-run exactly, by the stage-1 list scored (served, or "
            "rerun at the manifest's K)", ["list"], registry=r,
        )
        self.recall_dropped = Counter(
            "gare_stage1_recall_dropped", "sampled queries dropped: the re-run queue was full", registry=r
        )
        self.recall_skipped = Counter(
            "gare_stage1_recall_skipped", "sampled queries not evaluated, by reason (stale: served by a version no "
            "longer current; empty; unloaded; error)", ["reason"], registry=r,
        )
        self.recall_alarm = Gauge(
            "gare_stage1_recall_alarm", "1 while this worker's gare_stage1_recall_mean has stayed below the target for "
            "recall_alarm_after_s (retune: docs/retune.md), else 0", registry=r, multiprocess_mode="liveall",
        )
        self.recall_alarms = Counter(
            "gare_stage1_recall_alarms", "times the sustained-low-recall alarm went off", registry=r
        )
        self.recall_cpu = Counter(
            "gare_stage1_recall_cpu_seconds", "thread CPU seconds spent on the exact re-runs", registry=r
        )
        self.recall_mean.set(math.nan)
        self.recall_target.set(math.nan)
        # the shared engine (gare_serve.engine.engine_server; engine=shared): written by the engine process, and
        # by the HTTP workers for their side of each call
        self.engine_queue = Histogram(
            "gare_engine_queue_seconds", "shared engine: a query's wait from its arrival in the engine to the start "
            "of its batch", buckets=LATENCY_BUCKETS, registry=r,
        )
        self.engine_batch_workers = Histogram(
            "gare_engine_batch_workers", "shared engine: HTTP workers whose queries share one batch",
            buckets=BATCH_BUCKETS, registry=r,
        )
        self.engine_mixed_batches = Counter(
            "gare_engine_mixed_batches", "shared engine: batches holding queries of more than one HTTP worker",
            registry=r,
        )
        self.engine_requests = Counter(
            "gare_engine_requests", "shared engine: requests received, by kind (texts, videos, image, reload, "
            "status)", ["op"], registry=r,
        )
        self.engine_starts = Counter("gare_engine_starts", "shared engine: processes started (restarts included)",
                                     registry=r)
        self.engine_roundtrip = Histogram(
            "gare_engine_roundtrip_seconds", "HTTP worker: a request to the shared engine, sent to answered, by "
            "kind", ["op"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.engine_unavailable = Counter(
            "gare_engine_unavailable", "HTTP worker: calls the shared engine could not answer (down, restarting, "
            "not in time, version gone)", registry=r,
        )

    def observe_filter_plan(self, plan: str) -> None:
        self.filter_plans.labels(plan).inc()

    def observe_stages(self, timings_s: dict[str, float]) -> None:
        for stage, v in timings_s.items():
            self.stage.labels(stage).observe(max(0.0, float(v)))

    def set_index(self, version: str, index_type: str, checkpoint: str, n: int) -> None:
        if self._info_labels is not None:
            # in multiprocess mode clear() leaves the old value in this worker's file: zero it first
            self.info.labels(*self._info_labels).set(0)
        self.info.clear()
        self._info_labels = (version, index_type, checkpoint)
        self.info.labels(version, index_type, checkpoint).set(1)
        self.entries.set(n)

    def render(self) -> bytes:
        d = multiprocess_dir()
        if d is None:
            return generate_latest(self.registry)
        reg = CollectorRegistry()
        multiprocess.MultiProcessCollector(reg, path=d)  # every worker's series, merged
        return generate_latest(reg)


def _route_label(scope: dict[str, Any]) -> str:
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else "unmatched"


class MetricsMiddleware:
    """Pure ASGI middleware: counts every HTTP response (errors included) and times it by route."""

    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = {"code": 500}

        async def send_wrapper(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status["code"] = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = _route_label(scope)
            code = str(status["code"])
            m = self.metrics
            method = scope.get("method", "")
            # arbitrary method tokens must not mint new label sets (unbounded /metrics)
            m.requests.labels(route, method if method in _METHODS else "other", code).inc()
            if status["code"] >= 400:
                m.errors.labels(route, code).inc()
            m.latency.labels(route).observe(time.perf_counter() - start)
            m.worker_requests.inc()
