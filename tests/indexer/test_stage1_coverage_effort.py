"""Stage 1's search effort raised for psi's coverage (gare_build.tuning.version_tuning.raise_for_coverage): the
recall tuning sets the effort for the cosine top-10, and psi's top-10 lie deeper in the cosine ranking, where an
ANN tuned for the first ranks loses them. Here the answer sought lies at exact cosine ranks 150-159 of a clustered
gallery: an IVF probing one cell loses it at K = 256, exact search holds all of it; the effort goes up until the
ANN holds it too, each step recorded, and not past the latency limit."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from gare_build.tuning.coverage import ann_coverage, exact_coverage
from gare_build.tuning.ladder import TuneConfig, build_candidate
from gare_build.tuning.measure import exact_topk
from gare_build.tuning.version_tuning import raise_for_coverage

D, N, KS = 32, 20_000, (64, 128, 256)


@pytest.fixture(scope="module")
def setup():
    rng = np.random.default_rng(7)
    centres = rng.standard_normal((64, D)).astype(np.float32)
    x = centres[rng.integers(0, 64, N)] + 0.6 * rng.standard_normal((N, D)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    ids = np.arange(N, dtype=np.int64) * 3 + 11  # ids are not row numbers
    q = x[rng.choice(N, 40, replace=False)] + 0.3 * rng.standard_normal((40, D)).astype(np.float32)
    q = np.ascontiguousarray(q / np.linalg.norm(q, axis=1, keepdims=True), dtype=np.float32)
    _, rows = exact_topk(x, q, 160)
    truth = ids[rows[:, 150:160]]  # (40, 10): deep in each query's cosine ranking, as psi's answers can be
    cfg = TuneConfig(nlist=128, latency_budget_ms=5.0, latency_ceiling_ms=100.0, use_gpu=False)
    ivf, _ = build_candidate("ivf", x, ids, cfg, gpu=False)
    low = ivf.__class__(ivf.cpu_index, dataclasses.replace(ivf.params, nprobe=1), use_gpu=False)
    return x, ids, q, truth, cfg, low


def test_exact_and_ann_coverage_match_a_naive_count(setup):
    x, ids, q, truth, _, low = setup
    order = np.argsort(-(q @ x.T), axis=1, kind="stable")
    exact = exact_coverage(x, ids, q, truth, KS)
    for K in KS:
        naive = np.mean([np.isin(truth[i], ids[order[i, :K]]).mean() for i in range(len(q))])
        assert exact[K] == pytest.approx(naive, abs=1e-12)
    assert exact[64] == 0.0 and exact[256] == 1.0  # ranks 150-159: outside the top-64, all inside the top-256
    _, got = low.search(q, 256)
    cov = ann_coverage(low, q, truth, KS)
    assert cov[256] == pytest.approx(np.mean([np.isin(truth[i], got[i]).mean() for i in range(len(q))]), abs=1e-12)
    assert cov[256] < 0.9  # one cell of 128 probed: most of the answer is lost


def test_effort_is_raised_until_the_ann_holds_what_exact_search_holds(setup):
    x, ids, q, truth, cfg, low = setup
    exact = exact_coverage(x, ids, q, truth, KS)
    before = ann_coverage(low, q, truth, KS)[256]
    ann, cov, rec = raise_for_coverage(low, q, truth, KS, exact, 0.995, cfg, x, ids, gpu=False)
    assert rec["K"] == 256 and rec["goal"] == 0.995 and rec["raised"] and rec["from"] == "nlist=128 nprobe=1 coarse=flat"
    assert cov[256] >= 0.995 > before and ann.params.nprobe > 1 and rec["to"] == f"nlist=128 nprobe={ann.params.nprobe} coarse=flat"
    assert cov == ann_coverage(ann, q, truth, KS)  # what is returned is the raised ANN's coverage
    # each step went up once (nprobe x1.5) and recorded its coverage and latency; the step before the last fell short
    probes = [int(s["setting"].split("nprobe=")[1].split()[0]) for s in rec["steps"]]
    assert probes == sorted(probes) and probes[-1] == ann.params.nprobe and len(probes) >= 2
    assert all(s["coverage@256"] < 0.995 for s in rec["steps"][:-1]) and rec["steps"][-1]["coverage@256"] >= 0.995
    assert all(s["p50_ms_at_K"] > 0 for s in rec["steps"]) and "stopped" not in rec


def test_the_latency_limit_stops_the_raise(setup):
    x, ids, q, truth, cfg, low = setup
    exact = exact_coverage(x, ids, q, truth, KS)
    tight = dataclasses.replace(cfg, latency_budget_ms=1e-6, latency_ceiling_ms=1e-6)
    ann, cov, rec = raise_for_coverage(low, q, truth, KS, exact, 0.995, tight, x, ids, gpu=False)
    # the refused step's knobs are not left on the shared faiss index: the ANN returned searches as `low` did
    assert ann.params == low.params and not rec["raised"] and cov == ann_coverage(ann, q, truth, KS)
    assert cov == ann_coverage(low.__class__(low.cpu_index, low.params, use_gpu=False), q, truth, KS)
    assert rec.get("stopped") == "the latency limit 1e-06 ms" and "refused" in rec["steps"][0], rec


def test_nothing_to_raise_when_the_ann_already_holds_it(setup):
    x, ids, q, truth, cfg, low = setup
    exact = exact_coverage(x, ids, q, truth, KS)
    full = low.__class__(low.cpu_index, dataclasses.replace(low.params, nprobe=128), use_gpu=False)
    ann, cov, rec = raise_for_coverage(full, q, truth, KS, exact, 0.995, cfg, x, ids, gpu=False)
    assert ann.params == full.params and not rec["raised"] and rec["steps"] == [] and cov[256] == 1.0
