"""Stage-1 recall watched in production: a sample of served queries re-run exactly in the background.

The build measures stage 1 on a sample of queries (``gare_build.tuning.version_tuning``: recall@K of the exact
top-10, K the manifest's ``stage1.recall_at``, against ``stage1.recall_target``); real users may query elsewhere.
Each worker samples ``recall_sample_rate`` of the text queries it serves (unit vector, stage-1 ids served) into a
bounded queue (full: dropped, counted); one background thread computes per sample the exact top-10 of the *same
score* stage 1 ranks by, over the stage-1 vectors (InvGC-corrected when the index has them, as the tuner measures):
``cos(t, v̂_j)``, or ``+ b_j`` for the NCL fold (``ncl_stage1``, labelled ``stage1="ncl"``), in chunks
(``chunk_bytes``); then ``recall`` = |exact top-10 ∩ stage-1 top-K| / 10 at the manifest's K (the tuner's
definition, :func:`gare_build.tuning.measure.recall_of_topk`: the served list when served at that K, else stage 1
run again at it) and ``served_recall``, the same share inside the candidates served (the request's own K).
Where the exact answer and stage 1 come from is the watch's :class:`Stage1Source`: :class:`IndexSource` over one
index version by default; the Ray ingress's state brings its own (``recall_source()``:
``gare_serve.ray_serve.ingress_state.ShardSource``, a sharded generation probed shard by shard).

Metrics (``gare_stage1_recall*``, gare_serve.engine.prometheus): per-query histograms, this worker's rolling mean
over the last ``recall_window`` queries on the served version and its target, counters. A rolling mean (over at
least ``recall_warn_min_queries`` queries) below the target logs a WARNING, at most once per
``recall_warn_interval_s``; below it for ``recall_alarm_after_s`` of ``clock`` (every evaluation in that time), the
alarm goes off: one ERROR line naming the retune command, ``gare_stage1_recall_alarm`` = 1,
``gare_stage1_recall_alarms_total`` + 1 (docs/retune.md); it clears when the mean is back at the target or another
version is served.

CPU bound: the exact scan is numpy's single-threaded ``np.einsum``, counted by the thread's CPU clock; after every
chunk the thread sleeps until its CPU time since the sample's start is at most ``recall_cpu_share`` of the wall
time since then (:func:`gare_serve.engine.exact_scan.cpu_pacer`). (Stage 1 run again goes through FAISS, whose threads may be under-counted.)

Reloads: every evaluation takes the version served *now* (held, released after); samples served by another are
skipped (``reason="stale"``); a new version restarts the window with its own target and clears the alarm (at its
first evaluation, or within a second while the thread idles).
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
from typing import Any, Protocol

import numpy as np

from gare_index.store import IndexVersion
from gare_search.search import DEFAULT_CANDIDATES
from gare_serve.engine.exact_scan import CHUNK_BYTES, TOP, ScanStopped, cpu_pacer, exact_top

log = logging.getLogger(__name__)



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


class SkipSample(Exception):
    """A :class:`Stage1Source` cannot measure this sample: skipped, counted under the reason (its message)."""


@dataclass
class _VersionState:
    name: str
    target: float | None
    k_target: int
    window: deque = field(default_factory=deque)


class _SampledVersion:
    """The served version as the batch thread sees it: ``search`` also offers rows to the watch; everything else is
    the version's own attribute (the search reads frames, biases, ... through it)."""

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


def version_target(version: IndexVersion) -> tuple[float | None, int]:
    """(the version's recall target or None when it was not tuned, the K it is measured at, capped at n)."""
    st = getattr(getattr(version, "manifest", None), "stage1", None) or {}
    target = st.get("recall_target")
    k = st.get("recall_at") or DEFAULT_CANDIDATES
    n = int(version.n)
    return (float(target) if isinstance(target, (int, float)) else None), max(1, min(int(k), n) if n else int(k))


class Stage1Source(Protocol):
    """How a watch measures the served version. ``target``: (recall target or None, the K it is measured at);
    ``measure``: (the exact top-10 ids, the stage-1 ids at ``k_target``, whether stage 1 was run again for them)
    or :class:`SkipSample`, ``step()`` called between the scan's chunks; ``wrap``: the version the batch thread
    searches (one offering its stage-1 calls to the watch, or the version itself when samples come another way)."""

    def target(self, version: Any) -> tuple[float | None, int]: ...
    def measure(self, version: Any, sample: Sample, k_target: int,
                step: Callable[[], None]) -> tuple[np.ndarray, np.ndarray, bool]: ...
    def wrap(self, version: Any, watch: RecallWatch) -> Any: ...


class IndexSource:
    """The served version is one index version: the exact scan over its stage-1 vectors (``chunk_bytes`` a step),
    stage 1 run again through ``IndexVersion.search``, the version's own stage-1 calls sampled."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.chunk_bytes = max(1, int(chunk_bytes))

    def target(self, version: IndexVersion) -> tuple[float | None, int]:
        return version_target(version)

    def measure(self, version: IndexVersion, sample: Sample, k_target: int,
                step: Callable[[], None]) -> tuple[np.ndarray, np.ndarray, bool]:
        exact, _ = exact_top(version, sample.unit, TOP, ncl_stage1=sample.ncl_stage1,
                             chunk_rows=max(1, self.chunk_bytes // max(1, 4 * int(version.dim))), step=step)
        if sample.k == k_target:
            return exact, sample.served, False
        _, got = version.search(sample.unit[None, :], k_target, ncl_stage1=sample.ncl_stage1)
        return exact, got[0][got[0] >= 0], True

    def wrap(self, version: IndexVersion, watch: RecallWatch) -> Any:
        return _SampledVersion(version, watch)


class RecallWatch:
    """Samples served stage-1 lists and measures their recall against an exact search in a background thread.

    ``current()`` returns the service's current :class:`gare_serve.engine.versions.VersionHandle` (or None); ``metrics`` a
    :class:`gare_serve.engine.prometheus.Metrics` (None: counts only in :attr:`stats`). Thread-safe: :meth:`observe` /
    :meth:`offer` run on the batch thread, the evaluations on the watch's own thread (:meth:`start`). ``source``:
    what the exact answer and stage 1 come from (default :class:`IndexSource` with ``chunk_bytes``)."""

    def __init__(self, current: Callable[[], Any], metrics: Any = None, *, sample_rate: float = 0.01,
                 cpu_share: float = 0.05, queue_size: int = 64, window: int = 200, warn_min_queries: int = 50,
                 warn_interval_s: float = 600.0, chunk_bytes: int = CHUNK_BYTES, keep_recent: int = 256,
                 seed: int | None = None, alarm_after_s: float = 3600.0, clock: Callable[[], float] = time.monotonic,
                 source: Stage1Source | None = None) -> None:
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
        self.source: Stage1Source = source if source is not None else IndexSource(chunk_bytes)
        self.recent: deque[Evaluation] = deque(maxlen=keep_recent)
        self.stats: dict[str, Any] = {"sampled": 0, "evaluated": 0, "dropped": 0, "skipped": {}, "cpu_s": 0.0, "alarms": 0}
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
        """The version to hand to ``gare_search.search.search_batch``: its stage-1 calls feed the sample (the
        source's choice: :meth:`Stage1Source.wrap`)."""
        return self.source.wrap(version, self)

    def observe(self, version_name: str, queries: np.ndarray, ids: np.ndarray, k: int, ncl_stage1: bool) -> None:
        """One stage-1 call: offer each row with probability ``sample_rate``."""
        for r in range(int(np.shape(ids)[0])):
            if self.sample_rate >= 1.0 or self._rng.random() < self.sample_rate:
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
        t, self._thread = self._thread, None
        if t is not None:
            t.join(timeout)
            if t.is_alive():  # pragma: no cover - a chunk takes milliseconds
                log.warning("recall watch thread did not stop within %.0f s", timeout)

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
            try:
                if s is None:
                    self._follow_served()
                    continue
                self.evaluate(s, paced=True)
            except ScanStopped:
                return
            except Exception:  # noqa: BLE001 - the watch must never take the service down
                log.exception("recall watch: %s failed", "following the served version" if s is None else
                              "evaluating a sampled query")
                if s is not None:
                    self._skip("error")
            finally:
                with self._lock:
                    self._busy = False

    def _follow_served(self) -> None:
        """Idle: a newly served version restarts the window and clears the alarm now, not at its first sample."""
        h = self.current()
        if self._vs is not None and h is not None and not h.closed and h.version.name != self._vs.name:
            self._version_state(h.version)

    # ------------------------------------------------------------------ one evaluation
    def _skip(self, reason: str) -> None:
        with self._lock:
            sk = self.stats["skipped"]
            sk[reason] = sk.get(reason, 0) + 1
        if self.metrics is not None:
            self.metrics.recall_skipped.labels(reason).inc()

    def evaluate(self, sample: Sample, *, paced: bool = False) -> Evaluation | None:
        """Re-run one sample exactly on the current version; None when skipped (stale version, empty index)."""
        c0 = time.thread_time()
        pace = cpu_pacer(self.cpu_share, self._stop) if paced else (lambda: None)
        try:
            ev, vs = self._measure(sample, pace)
        except SkipSample as e:
            self._skip(str(e))
            return None
        self._record(ev, vs)
        ev.cpu_s = time.thread_time() - c0
        with self._lock:
            self.stats["cpu_s"] += ev.cpu_s
        if self.metrics is not None:
            self.metrics.recall_cpu.inc(ev.cpu_s)
        pace()
        return ev

    def _measure(self, sample: Sample, pace: Callable[[], None]) -> tuple[Evaluation, _VersionState]:
        h = self.current()
        if h is None:
            raise SkipSample("unloaded")
        h.acquire()
        try:
            if h.closed:  # retired and closed between reading the handle and acquiring it
                raise SkipSample("stale")
            vs = self._version_state(h.version)
            if sample.version != h.version.name:
                raise SkipSample("stale")
            if h.version.n == 0:  # (an empty served list on a non-empty index is a miss, scored as such)
                raise SkipSample("empty")
            exact, listed, rerun = self.source.measure(h.version, sample, vs.k_target, pace)
        finally:
            h.release()
        return Evaluation(sample, "ncl" if sample.ncl_stage1 else "cosine", exact, _share(exact, listed),
                          _share(exact, sample.served), vs.k_target, rerun, 0.0), vs

    def _version_state(self, version: IndexVersion) -> _VersionState:
        vs = self._vs
        if vs is None or vs.name != version.name:
            target, kt = self.source.target(version)
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
    return float(np.isin(exact, listed).sum() / exact.size) if exact.size else math.nan


def start_recall_watch(state: Any) -> RecallWatch | None:
    """The service's watch (settings ``recall_*``), started; None when ``recall_sample_rate`` is 0. A state that
    serves something else than one index version says how to measure it (``state.recall_source()``: the Ray
    ingress's sharded generation); else :class:`IndexSource`."""
    s = state.settings
    if s.recall_sample_rate <= 0:
        return None
    make_source = getattr(state, "recall_source", None)
    w = RecallWatch(lambda: state.handle, state.metrics, sample_rate=s.recall_sample_rate,
                    cpu_share=s.recall_cpu_share, queue_size=s.recall_queue_size, window=s.recall_window,
                    warn_min_queries=s.recall_warn_min_queries, warn_interval_s=s.recall_warn_interval_s,
                    alarm_after_s=s.recall_alarm_after_s, source=make_source() if make_source is not None else None)
    state.recall_watch = w
    return w.start()


__all__ = ["Sample", "Evaluation", "SkipSample", "Stage1Source", "IndexSource", "RecallWatch", "version_target",
           "start_recall_watch"]
