"""The recall watch's sustained-low-recall alarm (gare_serve/engine/recall_watch.py): when the rolling mean of real
recall observations (a deliberately weak IVF stage 1 re-run exactly) stays below the index's target for
``alarm_after_s`` of the watch's clock, one ERROR line, gauge ``gare_stage1_recall_alarm`` = 1 and the counter
``gare_stage1_recall_alarms_total`` + 1; not before that time, not at or above the target, cleared by a
recovery or a new version. The clock is injected: nothing sleeps."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest

from gare_index.ann import AnnIndex, build_index
from gare_index.ann_params import AnnParams
from gare_serve.engine.prometheus import Metrics
from gare_serve.engine.recall_watch import RecallWatch, Sample
from gare_serve.engine.versions import VersionHandle

N, D = 2000, 16


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _version(name: str, nprobe: int):
    """A version whose stage 1 is IVF over 2000 unit rows, 20 cells, ``nprobe`` probed (1: weak, 20: exact)."""
    rng = np.random.default_rng(0)
    units = rng.standard_normal((N, D)).astype(np.float32)
    units /= np.linalg.norm(units, axis=1, keepdims=True)
    ids = np.arange(N, dtype=np.int64)
    p = AnnParams("ivf", nlist=20, nprobe=nprobe, coarse="flat")
    ann = AnnIndex(build_index(units, ids, p, use_gpu=False), p)
    v = SimpleNamespace(name=name, n=N, dim=D, ids=ids, stage1_units=units, biases=np.zeros(N, np.float32),
                        manifest=SimpleNamespace(stage1={"recall_target": 0.995, "recall_at": 10}), close=lambda: None)
    v.search = lambda q, k, ncl_stage1=False: ann.search(q, k)
    return v


def _feed(watch: RecallWatch, v, rng, n: int) -> list[float]:
    """n served queries: stage 1 searched at K = 10, each sample re-run exactly by the watch."""
    q = rng.standard_normal((n, D)).astype(np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    _, got = v.search(q, 10)
    out = []
    for i in range(n):
        ev = watch.evaluate(Sample(v.name, q[i], got[i][got[i] >= 0], 10))
        out.append(ev.recall)
    return out


def _alarms(caplog):
    return [r for r in caplog.records if r.levelno == logging.ERROR and "stage-1 recall alarm" in r.getMessage()]


def test_alarm_after_the_set_time_below_the_target(caplog):
    caplog.set_level(logging.INFO, logger="gare_serve.engine.recall_watch")
    weak = _version("v1", nprobe=1)
    clock, m = Clock(), Metrics()
    h = VersionHandle(weak)
    watch = RecallWatch(lambda: h, m, sample_rate=1.0, window=20, warn_min_queries=10, alarm_after_s=600.0,
                        clock=clock)
    rng = np.random.default_rng(1)
    alarm = lambda: m.registry.get_sample_value("gare_stage1_recall_alarm")  # noqa: E731
    count = lambda: m.registry.get_sample_value("gare_stage1_recall_alarms_total")  # noqa: E731
    r = _feed(watch, weak, rng, 10)
    assert np.mean(r) < 0.9  # the premise: real recall observations, well below the 0.995 target
    assert alarm() == 0 and count() == 0 and not _alarms(caplog)  # below since now, not for 600 s yet
    clock.t += 599.0
    _feed(watch, weak, rng, 5)
    assert alarm() == 0 and not watch.alarmed and not _alarms(caplog)
    clock.t += 1.0
    _feed(watch, weak, rng, 1)
    assert watch.rolling_mean() < 0.995 and watch.alarmed and alarm() == 1 and count() == 1
    (rec,) = _alarms(caplog)
    msg = rec.getMessage()
    assert "below the target 0.9950 of v1 for 600 s" in msg and "--from-bank" in msg and "docs/retune.md" in msg
    clock.t += 5000.0
    _feed(watch, weak, rng, 5)  # still low: the alarm stays on, it does not go off again
    assert count() == 1 and len(_alarms(caplog)) == 1 and watch.stats["alarms"] == 1
    # a retuned version (every cell probed: exact, recall 1.0) is served: the alarm clears at once
    good = _version("v2", nprobe=20)
    h2 = VersionHandle(good)
    watch.current = lambda: h2
    assert _feed(watch, good, rng, 1) == [1.0]
    assert not watch.alarmed and alarm() == 0


def test_no_alarm_at_the_target_or_when_recall_recovers(caplog):
    caplog.set_level(logging.INFO, logger="gare_serve.engine.recall_watch")
    clock, m = Clock(), Metrics()
    good = _version("v1", nprobe=20)
    h = VersionHandle(good)
    watch = RecallWatch(lambda: h, m, sample_rate=1.0, window=20, warn_min_queries=10, alarm_after_s=60.0,
                        clock=clock)
    rng = np.random.default_rng(2)
    for _ in range(5):
        assert _feed(watch, good, rng, 10) == [1.0] * 10
        clock.t += 100.0
    assert not watch.alarmed and not _alarms(caplog)
    # low for 50 s, then a run of exact answers lifts the mean back: the low stretch starts again from zero
    weak = _version("v1", nprobe=1)  # same name: the same rolling window, now fed by a weak stage 1
    watch2 = RecallWatch(lambda: VersionHandle(weak), m, sample_rate=1.0, window=10, warn_min_queries=10,
                         alarm_after_s=60.0, clock=clock)
    _feed(watch2, weak, rng, 10)
    assert watch2.rolling_mean() < 0.995
    clock.t += 50.0
    watch2.current = lambda: VersionHandle(good)
    _feed(watch2, good, rng, 10)  # the window (10) now holds only exact answers
    assert watch2.rolling_mean() == 1.0
    watch2.current = lambda: VersionHandle(weak)
    _feed(watch2, weak, rng, 10)
    clock.t += 50.0  # 100 s since the first low reading, 50 s since the recovery
    _feed(watch2, weak, rng, 1)
    assert not watch2.alarmed and not _alarms(caplog)
    clock.t += 10.0
    _feed(watch2, weak, rng, 1)
    assert watch2.alarmed and len(_alarms(caplog)) == 1


def test_alarm_after_s_is_checked():
    with pytest.raises(ValueError, match="alarm_after_s must be >= 0, got -1"):
        RecallWatch(lambda: None, None, alarm_after_s=-1)
