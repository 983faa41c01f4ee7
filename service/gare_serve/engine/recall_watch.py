"""Stage-1 recall watched in production: a sample of served queries re-run exactly in the background.

The build measures stage 1 on a sample of queries (``gare_build.tuning.version_tuning``: recall@K of the exact top-10, K the
manifest's ``stage1.recall_at``, against ``stage1.recall_target``); real users may query elsewhere. Here each
worker samples ``recall_sample_rate`` of the text queries it serves (the rows its batch thread passes through
``IndexVersion.search``: the query's unit vector and the candidate ids actually served) into a bounded queue
(full: the sample is dropped and counted), and one background thread computes, per sample,

* the exact top-10 of the *same score* stage 1 ranks by, over the version's stage-1 vectors
  (``IndexVersion.stage1_units``: the InvGC-corrected ones when the index has them, as the tuner measures):
  ``cos(t, v̂_j)`` for the plain stage 1, ``cos(t, v̂_j) + b_j`` for the NCL fold (``ncl_stage1``: the search
  ``ann_ncl.faiss`` approximates; the tuner does not score it, the watcher does, labelled ``stage1="ncl"``).
  The scan reads the memory-mapped vectors in chunks (``chunk_bytes``), so memory stays bounded at any size;
* ``recall`` = |exact top-10 ∩ stage-1 top-K| / 10 with K = the manifest's ``recall_at`` (the tuner's
  definition, :func:`gare_build.tuning.measure.recall_of_topk`): the served list when the request was served at that K,
  else stage 1 run again at that K (deterministic on the CPU: the list a request at that K gets);
* ``served_recall``: the same share inside the candidates the request was actually served with (its own K).

Metrics (gare_serve.engine.prometheus): the per-query histograms ``gare_stage1_recall`` and ``gare_stage1_served_recall``
(``stage1`` label), this worker's rolling mean over the last ``recall_window`` queries on the served version
(``gare_stage1_recall_mean``, NaN until one is evaluated) next to the version's target
(``gare_stage1_recall_target``), and counters of sampled / evaluated / dropped / skipped queries and of the CPU
seconds spent. When the rolling mean (over at least ``recall_warn_min_queries`` queries) is below the target,
a WARNING is logged, at most once per ``recall_warn_interval_s``. When it has stayed below the target for
``recall_alarm_after_s`` (every evaluation in that time found it below, each over at least
``recall_warn_min_queries`` queries), the alarm goes off: one ERROR line naming the retune command,
``gare_stage1_recall_alarm`` = 1 and ``gare_stage1_recall_alarms_total`` + 1 (an alert rule or a scheduled
``gare-index tune --from-bank`` reads them: docs/retune.md); it clears (gauge 0) when the mean is back at the
target or another version is served. Time is read from ``clock`` (``time.monotonic``), which tests replace.

CPU bound: the exact scan is numpy's own single-threaded loop (``np.einsum``, no BLAS threads), so the thread's
CPU clock (``time.thread_time``) counts all of it; after every chunk the thread sleeps until its CPU time
since the sample's start is at most ``recall_cpu_share`` of the wall time since then. Every sample's window
therefore holds the bound, and so does any run of them. (The re-run of stage 1 at the manifest's K, a small
part of the work, goes through FAISS, which may use its OpenMP threads: that part can be under-counted.)

Reloads: every evaluation takes the version the service serves *now* (a reference, released after); samples
served by another version are skipped (``reason="stale"``) and a new version restarts the rolling window with
its own target.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gare_index.store import IndexVersion
from gare_search.search import DEFAULT_CANDIDATES

log = logging.getLogger(__name__)

TOP = 10  # the exact top-k whose recall is measured (gare_build.tuning.version_tuning: k = 10)
CHUNK_BYTES = 16 << 20  # stage-1 vectors read per step of the exact scan


@dataclass
class Sample:
    """One served query: its unit vector, the stage-1 ids it was served (best first) and how it was asked."""

    version: str
    unit: np.ndarray  # (d,) float32
    served: np.ndarray  # (<= k,) int64, valid ids only, in the order stage 1 returned them
    k: int  # the K the request asked stage 1 for
    ncl_stage1: bool = False


@dataclass
class Evaluation:
    """The exact re-run of one sample (kept in :attr:`RecallWatch.recent` for inspection)."""

    sample: Sample
    stage1: str  # "cosine" or "ncl": the score stage 1 ranks by and the exact search uses
    exact: np.ndarray  # the exact top-10 ids
    recall: float  # recall@k_target of the exact top-10
    served_recall: float  # the share of the exact top-10 inside the served candidates (the request's K)
    k_target: int  # the manifest's recall_at (capped at the index size)
    rerun: bool  # stage 1 was run again at k_target (the request used another K)
    cpu_s: float  # thread CPU seconds of this evaluation


class _Stopped(Exception):
    pass


@dataclass
class _VersionState:
    name: str
    target: float | None
    k_target: int
    window: deque = field(default_factory=deque)


class _SampledVersion:
    """The served version, seen through the batch thread: ``search`` also offers rows to the watch.

    Everything else is the version's own attribute (the search reads frames, biases, ... through it)."""

    def __init__(self, version: IndexVersion, watch: RecallWatch) -> None:
        self._version = version
        self._watch = watch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._version, name)

    def search(self, queries: np.ndarray, k: int, *, ncl_stage1: bool = False) -> tuple[np.ndarray, np.ndarray]:
        scores, ids = self._version.search(queries, k, ncl_stage1=ncl_stage1)
        try:
            self._watch.observe(self._version.name, queries, ids, int(k), ncl_stage1)
        except Exception:  # noqa: BLE001 - sampling must never fail a search
            log.exception("recall watch: sampling a stage-1 result failed")
        return scores, ids


def _stage1_record(version: IndexVersion) -> Any:
    m = getattr(version, "manifest", None)
    st = getattr(m, "stage1", None) if m is not None else None
    return st or {}


def version_target(version: IndexVersion) -> tuple[float | None, int]:
    """(the version's recall target or None when it was not tuned, the K it is measured at, capped at n)."""
    st = _stage1_record(version)
    target = st.get("recall_target")
    k = st.get("recall_at") or DEFAULT_CANDIDATES
    n = int(version.n)
    return (float(target) if isinstance(target, (int, float)) else None), max(1, min(int(k), n) if n else int(k))


class RecallWatch:
    """Samples served stage-1 lists and measures their recall against an exact search in a background thread.

    ``current()`` returns the service's current :class:`gare_serve.engine.versions.VersionHandle` (or None); ``metrics`` a
    :class:`gare_serve.engine.prometheus.Metrics` (None: counts only in :attr:`stats`). Thread-safe: :meth:`observe` /
    :meth:`offer` run on the batch thread, the evaluations on the watch's own thread (:meth:`start`)."""

    def __init__(
        self,
        current: Callable[[], Any],
        metrics: Any = None,
        *,
        sample_rate: float = 0.01,
        cpu_share: float = 0.05,
        queue_size: int = 64,
        window: int = 200,
        warn_min_queries: int = 50,
        warn_interval_s: float = 600.0,
        chunk_bytes: int = CHUNK_BYTES,
        keep_recent: int = 256,
        seed: int | None = None,
        alarm_after_s: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0.0 <= sample_rate <= 1.0:
            raise ValueError(f"sample_rate must be in [0, 1], got {sample_rate}")
        if not 0.0 < cpu_share <= 1.0:
            raise ValueError(f"cpu_share must be in (0, 1], got {cpu_share}")
        if queue_size < 1 or window < 1:
            raise ValueError(f"queue_size and window must be >= 1, got {queue_size}, {window}")
        self.current = current
        self.metrics = metrics
        self.sample_rate = float(sample_rate)
        self.cpu_share = float(cpu_share)
        self.queue_size = int(queue_size)
        self.window_size = int(window)
        self.warn_min_queries = max(1, min(int(warn_min_queries), self.window_size))
        self.warn_interval_s = float(warn_interval_s)
        if not alarm_after_s >= 0:
            raise ValueError(f"alarm_after_s must be >= 0, got {alarm_after_s}")
        self.alarm_after_s = float(alarm_after_s)
        self.clock = clock
        self._below_since: float | None = None  # clock time the rolling mean was first seen below the target
        self.alarmed = False  # the alarm is on (for the served version)
        self.chunk_bytes = max(1, int(chunk_bytes))
        self.recent: deque[Evaluation] = deque(maxlen=keep_recent)
        self.stats: dict[str, Any] = {"sampled": 0, "evaluated": 0, "dropped": 0, "skipped": {}, "cpu_s": 0.0,
                                      "alarms": 0}
        self._rng = random.Random(seed)
        self._queue: deque[Sample] = deque()
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._vs: _VersionState | None = None
        self._last_warn = -math.inf
        self._busy = False
        if metrics is not None:
            metrics.recall_mean.set(math.nan)
            metrics.recall_target.set(math.nan)
            metrics.recall_window.set(0)
            metrics.recall_alarm.set(0)

    # ------------------------------------------------------------------ sampling (batch thread)
    def wrap(self, version: IndexVersion) -> Any:
        """The version to hand to ``gare_search.search.search_batch``: its stage-1 calls feed the sample."""
        return _SampledVersion(version, self)

    def observe(self, version_name: str, queries: np.ndarray, ids: np.ndarray, k: int, ncl_stage1: bool) -> None:
        """One stage-1 call: offer each row with probability ``sample_rate``."""
        n = int(np.shape(ids)[0])
        rate = self.sample_rate
        for r in range(n):
            if rate >= 1.0 or self._rng.random() < rate:
                row = np.asarray(ids[r], dtype=np.int64)
                self.offer(Sample(version_name, np.array(queries[r], dtype=np.float32), row[row >= 0].copy(), k,
                                  bool(ncl_stage1)))

    def offer(self, sample: Sample) -> bool:
        """Queue a sample for its exact re-run; False (dropped, counted) when the queue is full."""
        with self._lock:
            self.stats["sampled"] += 1
            full = len(self._queue) >= self.queue_size
            if full:
                self.stats["dropped"] += 1
            else:
                self._queue.append(sample)
                self._ready.notify()
        m = self.metrics
        if m is not None:
            m.recall_sampled.inc()
            if full:
                m.recall_dropped.inc()
        return not full

    def queued(self) -> int:
        with self._lock:
            return len(self._queue)

    # ------------------------------------------------------------------ the thread
    def start(self) -> RecallWatch:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="gare-recall-watch", daemon=True)
            self._thread.start()
        return self

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        with self._lock:
            self._ready.notify_all()
        t = self._thread
        if t is not None:
            t.join(timeout)
            if t.is_alive():  # pragma: no cover - a chunk takes milliseconds
                log.warning("recall watch thread did not stop within %.0f s", timeout)
        self._thread = None

    def idle(self) -> bool:
        """Nothing queued and no evaluation running (tests wait for this)."""
        with self._lock:
            return not self._queue and not self._busy

    def _take(self, timeout: float) -> Sample | None:
        with self._lock:
            if not self._queue and not self._stop.is_set():
                self._ready.wait(timeout)
            if not self._queue:
                return None
            self._busy = True
            return self._queue.popleft()

    def _run(self) -> None:
        while not self._stop.is_set():
            s = self._take(0.5)
            if s is None:
                continue
            try:
                self.evaluate(s, paced=True)
            except _Stopped:
                return
            except Exception:  # noqa: BLE001 - the watch must never take the service down
                log.exception("recall watch: evaluating a sampled query failed")
                self._skip("error")
            finally:
                with self._lock:
                    self._busy = False

    # ------------------------------------------------------------------ one evaluation
    def _pace(self, c0: float, w0: float) -> None:
        """Sleep until the CPU time since (c0, w0) is at most cpu_share of the wall time since w0."""
        if self._stop.is_set():
            raise _Stopped
        wait = (time.thread_time() - c0) / self.cpu_share - (time.perf_counter() - w0)
        if wait > 0 and self._stop.wait(wait):
            raise _Stopped

    def _skip(self, reason: str) -> None:
        with self._lock:
            sk = self.stats["skipped"]
            sk[reason] = sk.get(reason, 0) + 1
        if self.metrics is not None:
            self.metrics.recall_skipped.labels(reason).inc()

    def evaluate(self, sample: Sample, *, paced: bool = False) -> Evaluation | None:
        """Re-run one sample exactly on the current version; None when skipped (stale version, empty index)."""
        c0, w0 = time.thread_time(), time.perf_counter()
        h = self.current()
        if h is None:
            self._skip("unloaded")
            return None
        h.acquire()
        try:
            if h.closed:  # retired and closed between reading the handle and acquiring it
                self._skip("stale")
                return None
            version = h.version
            vs = self._version_state(version)
            if sample.version != version.name:
                self._skip("stale")
                return None
            if version.n == 0:  # (an empty served list on a non-empty index is a miss, scored as such)
                self._skip("empty")
                return None
            pace = (lambda: self._pace(c0, w0)) if paced else (lambda: None)
            exact = exact_top(version, sample.unit, TOP, ncl_stage1=sample.ncl_stage1,
                              chunk_rows=max(1, self.chunk_bytes // max(1, 4 * int(version.dim))), step=pace)
            kt = vs.k_target
            if sample.k == kt:
                listed, rerun = sample.served, False
            else:
                _, got = version.search(sample.unit[None, :], kt, ncl_stage1=sample.ncl_stage1)
                listed, rerun = got[0][got[0] >= 0], True
            recall = _share(exact, listed)
            served = _share(exact, sample.served)
        finally:
            h.release()
        ev = Evaluation(sample, "ncl" if sample.ncl_stage1 else "cosine", exact, recall, served, kt, rerun, 0.0)
        self._record(ev, vs)
        ev.cpu_s = time.thread_time() - c0
        with self._lock:
            self.stats["cpu_s"] += ev.cpu_s
        if self.metrics is not None:
            self.metrics.recall_cpu.inc(ev.cpu_s)
        if paced:
            self._pace(c0, w0)
        return ev

    def _version_state(self, version: IndexVersion) -> _VersionState:
        vs = self._vs
        if vs is None or vs.name != version.name:
            target, kt = version_target(version)
            vs = self._vs = _VersionState(version.name, target, kt, deque(maxlen=self.window_size))
            self._last_warn = -math.inf
            self._clear_alarm()
            m = self.metrics
            if m is not None:
                m.recall_target.set(math.nan if target is None else target)
                m.recall_mean.set(math.nan)
                m.recall_window.set(0)
            log.info("recall watch: measuring stage 1 of %s (recall@%d of the exact top-%d, target %s)",
                     version.name, kt, TOP, "none (not tuned)" if target is None else target)
        return vs

    def _record(self, ev: Evaluation, vs: _VersionState) -> None:
        vs.window.append(ev.recall)
        mean = float(np.mean(vs.window))
        with self._lock:
            self.stats["evaluated"] += 1
            self.recent.append(ev)
        m = self.metrics
        if m is not None:
            m.recall.labels(ev.stage1).observe(ev.recall)
            m.recall_served.labels(ev.stage1).observe(ev.served_recall)
            m.recall_evaluated.labels("rerun" if ev.rerun else "served").inc()
            m.recall_mean.set(mean)
            m.recall_window.set(len(vs.window))
        self._maybe_warn(vs, mean)

    def rolling_mean(self) -> float:
        vs = self._vs
        return float(np.mean(vs.window)) if vs is not None and vs.window else math.nan

    def _clear_alarm(self) -> None:
        self._below_since = None
        if self.alarmed:
            self.alarmed = False
            if self.metrics is not None:
                self.metrics.recall_alarm.set(0)

    def _maybe_alarm(self, vs: _VersionState, mean: float, n: int) -> None:
        """The sustained-low-recall alarm: below the target for alarm_after_s of the watch's clock."""
        if vs.target is None or n < self.warn_min_queries:
            return  # too few queries to say either way: the state stays as it is
        if not mean < vs.target:
            self._clear_alarm()
            return
        now = self.clock()
        if self._below_since is None:
            self._below_since = now
        below_s = now - self._below_since
        if self.alarmed or below_s < self.alarm_after_s:
            return
        self.alarmed = True
        with self._lock:
            self.stats["alarms"] = self.stats.get("alarms", 0) + 1
        if self.metrics is not None:
            self.metrics.recall_alarm.set(1)
            self.metrics.recall_alarms.inc()
        log.error(
            "stage-1 recall alarm: the rolling recall@%d of the exact top-%d has stayed below the target %.4f of %s for "
            "%.0f s (now %.4f over the last %d sampled queries). Retune stage 1 on served queries: `gare-index tune "
            "--out INDEX --from-bank BANK.npy` (a new version the workers follow; docs/retune.md)", vs.k_target, TOP,
            vs.target, vs.name, below_s, mean, n)

    def _maybe_warn(self, vs: _VersionState, mean: float) -> None:
        n = len(vs.window)
        self._maybe_alarm(vs, mean, n)
        if vs.target is None or n < self.warn_min_queries or not mean < vs.target:
            return
        now = time.monotonic()
        if now - self._last_warn < self.warn_interval_s:
            return
        self._last_warn = now
        se = float(np.std(vs.window) / math.sqrt(n))
        log.warning(
            "stage-1 recall@%d of the exact top-%d is %.4f (standard error %.4f) over the last %d sampled queries on %s, below the "
            "index's target %.4f (measured at build time on its own sample of queries): served queries differ from "
            "that sample. Retune on them: record served queries (GARE_QUERY_BANK_SIZE, GARE_QUERY_BANK_PATH) and run "
            "`gare-index tune --out INDEX --from-bank BANK.npy`", vs.k_target, TOP, mean, se, n, vs.name, vs.target)


def _share(exact: np.ndarray, listed: np.ndarray) -> float:
    """|exact ∩ listed| / |exact| (gare_build.tuning.measure.recall_of_topk for one query)."""
    if exact.size == 0:
        return math.nan
    return float(np.isin(exact, listed).sum() / exact.size)


def exact_top(version: IndexVersion, unit: np.ndarray, top: int = TOP, *, ncl_stage1: bool = False, chunk_rows: int = 65536,
              step: Callable[[], None] | None = None) -> np.ndarray:
    """The exact top-``top`` ids by ``unit · v̂_j`` (+ ``b_j`` with ``ncl_stage1``) over ``version.stage1_units``.

    Reads ``chunk_rows`` rows at a time (a memmap stays a memmap: memory is one chunk's scores), scores them
    with numpy's single-threaded einsum and keeps the best ``top`` (ties: the lower row); ``step()`` runs
    after every chunk (the watch's pacing)."""
    units = version.stage1_units
    n = int(units.shape[0])
    q = np.ascontiguousarray(unit, dtype=np.float32).reshape(-1)
    biases = np.asarray(version.biases, dtype=np.float32) if ncl_stage1 else None
    top = min(int(top), n)
    best_s = np.zeros(0, np.float32)
    best_r = np.zeros(0, np.int64)
    for s in range(0, n, max(1, int(chunk_rows))):
        e = min(n, s + int(chunk_rows))
        block = np.asarray(units[s:e])
        if block.dtype != np.float32:
            block = block.astype(np.float32)
        sc = np.einsum("nd,d->n", block, q)
        if biases is not None:
            sc = sc + biases[s:e]
        if e - s > top:
            keep = np.argpartition(-sc, top - 1)[:top]
        else:
            keep = np.arange(e - s)
        cs = np.concatenate([best_s, sc[keep]])
        cr = np.concatenate([best_r, keep.astype(np.int64) + s])
        order = np.lexsort((cr, -cs))[:top]
        best_s, best_r = cs[order], cr[order]
        if step is not None:
            step()
    return np.asarray(version.ids, dtype=np.int64)[best_r]


def start_recall_watch(state: Any) -> RecallWatch | None:
    """The service's watch (settings ``recall_*``), started; None when ``recall_sample_rate`` is 0."""
    s = state.settings
    if s.recall_sample_rate <= 0:
        return None
    w = RecallWatch(lambda: state.handle, state.metrics, sample_rate=s.recall_sample_rate,
                    cpu_share=s.recall_cpu_share, queue_size=s.recall_queue_size, window=s.recall_window,
                    warn_min_queries=s.recall_warn_min_queries, warn_interval_s=s.recall_warn_interval_s,
                    alarm_after_s=s.recall_alarm_after_s)
    state.recall_watch = w
    return w.start()


__all__ = ["TOP", "Sample", "Evaluation", "RecallWatch", "exact_top", "version_target", "start_recall_watch"]
